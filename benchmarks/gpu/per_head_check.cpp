// Times per-head eviction (llama_kvp_*) against shared eviction on the backend that holds the cache (CUDA when built
// with it and -ngl > 0, else the CPU). Standalone: links libllama only.
//
// Both modes run the bounded protocol on random tokens: a context of --budget cells is filled by a prefill, then
// every step adds --chunk tokens after evicting --chunk: shared mode removes the same random positions from every
// head (llama_memory_seq_rm, one position at a time), per-head mode a different random set per (layer, KV head)
// (llama_kvp_evict, whose row moves copy K/V rows inside the cache). Runs interleaved, the median of --repeats after
// a warm-up; reported per step: the decode, the eviction, and their sum as a ratio of per-head to shared.
//
//    per_head_check -m model.gguf [-ngl 99] [--budget 1024] [--chunks 1,16,64] [--steps 32] [--repeats 5] [-o out.json]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "check_common.h"
#include "llama.h"

namespace {

using check::Clock;
using check::median;
using check::seconds_since;

struct Options {
    std::string model;
    int n_gpu_layers = 99;
    int budget = 1024;
    std::vector<int> chunks = {1, 16, 64};
    int steps = 32;
    int repeats = 5;
    int n_threads = 8;
    std::string out = "per_head_check.json";
};

void decode_or_die(llama_context* ctx, const std::vector<llama_token>& tokens, llama_pos first_pos) {
    check::decode_tokens(ctx, tokens, first_pos);
    llama_synchronize(ctx);
}

struct Timing {
    double decode_ms = 0, evict_ms = 0;
};

// One bounded run: prefill to the budget, then `steps` rounds of evict `chunk` + decode `chunk`.
Timing run(llama_model* model, const Options& o, bool per_head, int chunk, std::mt19937& rng) {
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = uint32_t(o.budget);
    cp.n_batch = cp.n_ubatch = 512;
    cp.n_seq_max = 1;
    cp.n_threads = cp.n_threads_batch = o.n_threads;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_AUTO;
    llama_context* ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        std::fprintf(stderr, "llama_init_from_model failed\n");
        std::exit(1);
    }
    const uint32_t n_cells = llama_n_ctx(ctx);
    if (per_head && llama_kvp_enable(ctx) != 0) {
        std::fprintf(stderr, "llama_kvp_enable failed\n");
        std::exit(1);
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    auto random_tokens = [&](int n) {
        std::vector<llama_token> t(static_cast<size_t>(n));
        for (auto& x : t) x = llama_token(rng() % uint32_t(n_vocab));
        return t;
    };
    decode_or_die(ctx, random_tokens(int(n_cells)), 0);
    llama_pos next = llama_pos(n_cells);
    std::vector<llama_pos> shared_held(n_cells);  // shared mode: the positions the cache holds
    for (uint32_t i = 0; i < n_cells; ++i) shared_held[i] = llama_pos(i);

    const int n_layer = per_head ? llama_kvp_n_layer(ctx) : 0;
    const int n_head = per_head ? llama_kvp_n_head_kv(ctx) : 0;
    std::vector<llama_pos> held(n_cells), evict;
    llama_memory_t mem = llama_get_memory(ctx);
    Timing t;
    for (int s = 0; s < o.steps; ++s) {
        // the positions to drop, chosen before the clock starts; the first 4 (attention sinks) and the newest token
        // (a batch must continue the sequence from its largest position) stay
        std::vector<llama_pos> shared_pos;
        evict.clear();
        if (per_head) {
            for (int il = 0; il < n_layer; ++il)
                for (int ih = 0; ih < n_head; ++ih) {
                    llama_kvp_head_pos(ctx, il, ih, held.data(), int32_t(n_cells));
                    std::vector<llama_pos> mine;
                    for (llama_pos p : held)
                        if (p >= 4 && p != next - 1) mine.push_back(p);
                    std::shuffle(mine.begin(), mine.end(), rng);
                    evict.insert(evict.end(), mine.begin(), mine.begin() + chunk);
                }
        } else {
            // the newest token stays last in shared_held
            std::shuffle(shared_held.begin() + 4, shared_held.end() - 1, rng);
            shared_pos.assign(shared_held.end() - 1 - chunk, shared_held.end() - 1);
            shared_held.erase(shared_held.end() - 1 - chunk, shared_held.end() - 1);
            for (int i = 0; i < chunk; ++i) shared_held.push_back(next + i);
        }
        auto start = Clock::now();
        if (per_head) {
            if (llama_kvp_evict(ctx, chunk, evict.data()) != 0) {
                std::fprintf(stderr, "llama_kvp_evict failed\n");
                std::exit(1);
            }
        } else {
            for (llama_pos p : shared_pos) llama_memory_seq_rm(mem, 0, p, p + 1);
        }
        t.evict_ms += 1000.0 * seconds_since(start);
        start = Clock::now();
        decode_or_die(ctx, random_tokens(chunk), next);
        t.decode_ms += 1000.0 * seconds_since(start);
        next += chunk;
    }
    llama_free(ctx);
    t.decode_ms /= o.steps;
    t.evict_ms /= o.steps;
    return t;
}

std::vector<int> parse_list(const std::string& s) {
    std::vector<int> out;
    for (size_t i = 0; i < s.size();) {
        const size_t j = s.find(',', i);
        out.push_back(std::atoi(s.substr(i, j == std::string::npos ? std::string::npos : j - i).c_str()));
        if (j == std::string::npos) break;
        i = j + 1;
    }
    return out;
}

}  // namespace

int main(int argc, char** argv) {
    Options o;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
        if (a == "-m") o.model = next();
        else if (a == "-ngl") o.n_gpu_layers = std::atoi(next().c_str());
        else if (a == "--budget") o.budget = std::atoi(next().c_str());
        else if (a == "--chunks") o.chunks = parse_list(next());
        else if (a == "--steps") o.steps = std::atoi(next().c_str());
        else if (a == "--repeats") o.repeats = std::atoi(next().c_str());
        else if (a == "-t") o.n_threads = std::atoi(next().c_str());
        else if (a == "-o") o.out = next();
        else {
            std::fprintf(stderr, "unknown argument %s\n", a.c_str());
            return 2;
        }
    }
    const int max_chunk = o.chunks.empty() ? 0 : *std::max_element(o.chunks.begin(), o.chunks.end());
    if (o.model.empty() || o.chunks.empty() || *std::min_element(o.chunks.begin(), o.chunks.end()) < 1 ||
        o.budget < 4 + 2 * max_chunk || o.steps < 1 || o.repeats < 1) {
        std::fprintf(stderr, "usage: %s -m model.gguf [-ngl N] [--budget N] [--chunks 1,16,64] [--steps N] "
                             "[--repeats N] [-o out.json]\n", argv[0]);
        return 2;
    }

    llama_model* model = check::load_model_or_die(o.model, o.n_gpu_layers);

    FILE* f = std::fopen(o.out.c_str(), "w");
    if (!f) return 1;
    std::fprintf(f, "{\n \"n_gpu_layers\": %d, \"budget\": %d, \"steps\": %d, \"repeats\": %d,\n \"rows\": [\n",
                 o.n_gpu_layers, o.budget, o.steps, o.repeats);
    std::printf("| tokens per step | shared decode ms | shared evict ms | per-head decode ms | per-head evict ms | "
                "per-head / shared (step) |\n|---|---|---|---|---|---|\n");
    std::mt19937 rng(11);
    for (size_t ci = 0; ci < o.chunks.size(); ++ci) {
        const int chunk = o.chunks[ci];
        std::vector<double> dec[2], ev[2];
        for (int r = -1; r < o.repeats; ++r) {  // r = -1: warm-up
            for (int m = 0; m < 2; ++m) {
                const Timing t = run(model, o, m == 1, chunk, rng);
                if (r < 0) continue;
                dec[m].push_back(t.decode_ms);
                ev[m].push_back(t.evict_ms);
            }
        }
        const double d0 = median(dec[0]), e0 = median(ev[0]), d1 = median(dec[1]), e1 = median(ev[1]);
        // the ratio of medians of whole steps, each run's decode + evict
        std::vector<double> step0, step1;
        for (size_t i = 0; i < dec[0].size(); ++i) step0.push_back(dec[0][i] + ev[0][i]);
        for (size_t i = 0; i < dec[1].size(); ++i) step1.push_back(dec[1][i] + ev[1][i]);
        const double ratio = median(step1) / median(step0);
        std::printf("| %d | %.3f | %.3f | %.3f | %.3f | %.3f |\n", chunk, d0, e0, d1, e1, ratio);
        std::fprintf(f, "  {\"tokens_per_step\": %d, \"shared_decode_ms\": %.4f, \"shared_evict_ms\": %.4f, "
                        "\"per_head_decode_ms\": %.4f, \"per_head_evict_ms\": %.4f, \"per_head_step_over_shared\": %.4f}%s\n",
                     chunk, d0, e0, d1, e1, ratio, ci + 1 < o.chunks.size() ? "," : "");
    }
    std::fprintf(f, " ]\n}\n");
    std::fclose(f);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
