// What the GPU check programs share: timing, medians, and decoding a token run through the public llama.cpp API.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "llama.h"

namespace check {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

inline double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
}

// Decodes `tokens` at positions first_pos, first_pos + 1, ... in batches of n_batch, logits for the last token of
// each batch only; exits on a failed decode. Does not synchronize.
inline void decode_tokens(llama_context* ctx, const std::vector<llama_token>& tokens, llama_pos first_pos) {
    const size_t n_batch = llama_n_batch(ctx);
    for (size_t start = 0; start < tokens.size(); start += n_batch) {
        const int n = int(std::min(n_batch, tokens.size() - start));
        llama_batch batch = llama_batch_init(n, 0, 1);
        for (int i = 0; i < n; ++i) {
            batch.token[i] = tokens[start + size_t(i)];
            batch.pos[i] = first_pos + llama_pos(start) + i;
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = i == n - 1;
        }
        batch.n_tokens = n;
        if (llama_decode(ctx, batch) != 0) {
            std::fprintf(stderr, "llama_decode failed\n");
            std::exit(1);
        }
        llama_batch_free(batch);
    }
}

// Initialises the backends and loads the model with n_gpu_layers on the GPU; exits if it cannot be loaded.
inline llama_model* load_model_or_die(const std::string& path, int n_gpu_layers) {
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = n_gpu_layers;
    // GCC-built AMX kernels of this llama.cpp raise SIGILL (python/kvp_cpp/_amx.py)
    if (std::strstr(llama_print_system_info(), "AMX_INT8 = 1")) mp.use_extra_bufts = false;
    llama_model* model = llama_model_load_from_file(path.c_str(), mp);
    if (!model) {
        std::fprintf(stderr, "cannot load %s\n", path.c_str());
        std::exit(1);
    }
    return model;
}

}  // namespace check
