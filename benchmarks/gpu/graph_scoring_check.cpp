// Checks and times the patched llama.cpp's in-graph scoring (llama_kvp_scorer_*) on the backend that holds the
// layers (CUDA when built with it and -ngl > 0, else the CPU). Standalone: links libllama only, and uses a random
// MLP of the shape kvp ships (D -> 32 -> 1, relu, log and linear position features) on every layer.
//
// 1. Correctness: one decode with the in-graph scorer and an eval callback that copies each layer's Kcur/Vcur
//    out: the in-graph scores against a double-precision MLP on those same K/V.
// 2. Speed, each mode in its own context, runs interleaved, median of --repeats after a warm-up:
//      none      plain llama.cpp
//      graph     the in-graph scorer (no eval callback)
//      callback  kvp's stock path: an eval callback that asks for Kcur/Vcur of every layer (the scheduler then
//                synchronizes the device before each), copies them to the host and scores them there
//    prefill tokens/s of --prompt tokens, and ms per decoded token over --decode single-token steps.
//
//    graph_scoring_check -m model.gguf [-ngl 99] [--prompt 2048] [--decode 128] [--repeats 5] [-o out.json]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ggml-backend.h"
#include "ggml.h"
#include "check_common.h"
#include "llama.h"

namespace {

using check::Clock;
using check::seconds_since;

struct Options {
    std::string model;
    int n_gpu_layers = 99;
    int n_prompt = 2048;
    int n_decode = 128;
    int repeats = 5;
    int n_threads = 4;
    std::string out = "graph_scoring_check.json";
    std::string dump_scores;  // the correctness decode's in-graph scores, raw float32 [layer][token][head]
};

// One MLP per (layer, KV head): [k, v, log(1+p)/a0, p/a1] -> (x - shift) * scale -> relu(W1 x + b1) -> w2 . h + b2
struct Mlp {
    int n_layer = 0, n_head = 0, dk = 0, dv = 0, hidden = 32;
    float a_log = 0, a_lin = 0;
    std::vector<float> shift, scale, w1, b1, w2, b2;  // per layer: [H][D], [H][D], [H][hidden][D], [H][hidden], [H][hidden], [H]
    int D() const { return dk + dv + 2; }

    void randomize(uint32_t seed) {
        std::mt19937 rng(seed);
        std::normal_distribution<float> normal(0.0f, 1.0f);
        std::uniform_real_distribution<float> uniform(0.5f, 1.5f);
        const size_t L = n_layer, H = n_head, d = D();
        shift.resize(L * H * d), scale.resize(L * H * d);
        w1.resize(L * H * hidden * d), b1.resize(L * H * hidden), w2.resize(L * H * hidden), b2.resize(L * H);
        for (auto& x : shift) x = 0.1f * normal(rng);
        for (auto& x : scale) x = uniform(rng);
        for (auto& x : w1) x = normal(rng) * std::sqrt(2.0f / float(d));
        for (auto& x : b1) x = 0.1f * normal(rng);
        for (auto& x : w2) x = normal(rng) * std::sqrt(2.0f / float(hidden));
        for (auto& x : b2) x = 0.1f * normal(rng);
    }

    void upload(llama_context* ctx) const {
        const int32_t widths[3] = {D(), hidden, 1};
        const int32_t kinds[2] = {LLAMA_KVP_POS_LOG, LLAMA_KVP_POS_LINEAR};
        const float a[2] = {a_log, a_lin};
        if (llama_kvp_scorer_init(ctx, 2, widths, LLAMA_KVP_ACT_RELU, 2, kinds, a) != 0) {
            std::fprintf(stderr, "llama_kvp_scorer_init failed\n");
            std::exit(1);
        }
        const size_t H = n_head, d = D();
        for (int l = 0; l < n_layer; ++l) {
            const float* w[2] = {&w1[l * H * hidden * d], &w2[l * H * hidden]};
            const float* b[2] = {&b1[l * H * hidden], &b2[l * H]};
            if (llama_kvp_scorer_set_layer(ctx, l, &shift[l * H * d], &scale[l * H * d], w, b) != 0) {
                std::fprintf(stderr, "llama_kvp_scorer_set_layer(%d) failed\n", l);
                std::exit(1);
            }
        }
    }

    // The score of one (layer, head) for one token, in double: the reference.
    double score(int l, int h, const float* k, const float* v, int64_t pos) const {
        const size_t H = n_head, d = D();
        std::vector<double> x(d);
        for (int i = 0; i < dk; ++i) x[i] = k[i];
        for (int i = 0; i < dv; ++i) x[dk + i] = v[i];
        x[dk + dv] = double(float(std::log(1.0 + double(pos)) / double(a_log)));
        x[dk + dv + 1] = double(float(double(pos) / double(a_lin)));
        const size_t lh = size_t(l) * H + h;
        for (size_t i = 0; i < d; ++i) x[i] = (x[i] - shift[lh * d + i]) * scale[lh * d + i];
        double out = b2[lh];
        for (int j = 0; j < hidden; ++j) {
            double acc = b1[lh * hidden + j];
            for (size_t i = 0; i < d; ++i) acc += double(w1[(lh * hidden + j) * d + i]) * x[i];
            out += double(w2[lh * hidden + j]) * std::max(acc, 0.0);
        }
        return out;
    }
};

// Kcur-<l> / Vcur-<l> copied out by the eval callback: [token][head][dim] as float, with the tokens' positions.
struct Capture {
    const Mlp* mlp = nullptr;
    bool score_on_host = false;  // the callback path: score each layer's tokens as kvp's engine does
    std::vector<std::vector<float>> k, v;
    std::vector<int> arrived;  // per layer: K and V seen in this ubatch (graph order puts either first)
    std::vector<float> host_scores;
    int64_t n_tokens = 0, first_pos = 0;

    static int layer_of(const char* name, const char* prefix) {
        const size_t n = std::strlen(prefix);
        if (std::strncmp(name, prefix, n) != 0) return -1;
        char* end = nullptr;
        const long layer = std::strtol(name + n, &end, 10);
        return (end && *end == '\0' && end != name + n) ? int(layer) : -1;
    }

    static bool callback(ggml_tensor* t, bool ask, void* user_data) {
        auto* self = static_cast<Capture*>(user_data);
        const Mlp& mlp = *self->mlp;
        // Kcur-<l> names the projection, its reshape and the RoPE: the post-RoPE K is the ROPE node; Vcur-<l> is
        // the projection and its reshape to [head_dim, n_head_kv, tokens]
        int lk = layer_of(t->name, "Kcur-"), lv = layer_of(t->name, "Vcur-");
        const bool shaped = t->type == GGML_TYPE_F32 && t->nb[0] == sizeof(float) && t->ne[1] == mlp.n_head;
        if (!(shaped && t->op == GGML_OP_ROPE && t->ne[0] == mlp.dk)) lk = -1;
        if (!(shaped && t->op == GGML_OP_RESHAPE && t->ne[0] == mlp.dv)) lv = -1;
        const int layer = lk >= 0 ? lk : lv;
        if (ask) return layer >= 0 && layer < mlp.n_layer;
        if (layer < 0 || layer >= mlp.n_layer) return true;
        std::vector<uint8_t> raw(ggml_nbytes(t));
        ggml_backend_tensor_get(t, raw.data(), 0, raw.size());
        auto& dst = (lk >= 0 ? self->k : self->v)[layer];
        const int64_t dim = t->ne[0], heads = t->ne[1], tokens = t->ne[2];
        dst.resize(size_t(dim * heads * tokens));
        for (int64_t tok = 0; tok < tokens; ++tok)
            for (int64_t h = 0; h < heads; ++h)
                std::memcpy(&dst[size_t((tok * heads + h) * dim)], raw.data() + tok * t->nb[2] + h * t->nb[1],
                            size_t(dim) * sizeof(float));
        self->n_tokens = tokens;
        if (self->arrived.size() < self->k.size()) self->arrived.assign(self->k.size(), 0);
        if (++self->arrived[size_t(layer)] < 2) return true;
        self->arrived[size_t(layer)] = 0;
        if (self->score_on_host) {
            const Mlp& m = mlp;
            self->host_scores.resize(size_t(tokens * m.n_head));
            for (int64_t tok = 0; tok < tokens; ++tok)
                for (int h = 0; h < m.n_head; ++h)
                    self->host_scores[size_t(tok * m.n_head + h)] = float(m.score(
                        layer, h, &self->k[layer][size_t((tok * m.n_head + h) * m.dk)],
                        &self->v[layer][size_t((tok * m.n_head + h) * m.dv)], self->first_pos + tok));
        }
        return true;
    }
};

enum class Mode { none, graph, callback };
const char* mode_name(Mode m) { return m == Mode::none ? "none" : m == Mode::graph ? "graph" : "callback"; }

llama_context* make_context(llama_model* model, const Options& o, Mode mode, Capture* capture, bool reference) {
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = uint32_t(o.n_prompt + o.n_decode + 16);
    cp.n_batch = cp.n_ubatch = 512;
    cp.n_threads = cp.n_threads_batch = o.n_threads;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_AUTO;  // the GPU build may leave out the flash-attention kernels
    if (mode == Mode::callback || reference) {
        cp.cb_eval = &Capture::callback;
        cp.cb_eval_user_data = capture;
    }
    llama_context* ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        std::fprintf(stderr, "llama_init_from_model failed\n");
        std::exit(1);
    }
    return ctx;
}

}  // namespace

int main(int argc, char** argv) {
    Options o;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
        if (a == "-m") o.model = next();
        else if (a == "-ngl") o.n_gpu_layers = std::atoi(next().c_str());
        else if (a == "--prompt") o.n_prompt = std::atoi(next().c_str());
        else if (a == "--decode") o.n_decode = std::atoi(next().c_str());
        else if (a == "--repeats") o.repeats = std::atoi(next().c_str());
        else if (a == "-t") o.n_threads = std::atoi(next().c_str());
        else if (a == "-o") o.out = next();
        else if (a == "--dump-scores") o.dump_scores = next();
        else {
            std::fprintf(stderr, "unknown argument %s\n", a.c_str());
            return 2;
        }
    }
    if (o.model.empty() || o.n_prompt < 16 || o.n_decode < 1 || o.repeats < 1) {
        std::fprintf(stderr, "usage: %s -m model.gguf [-ngl N] [--prompt N] [--decode N] [--repeats N] [-o out]\n", argv[0]);
        return 2;
    }

    llama_model* model = check::load_model_or_die(o.model, o.n_gpu_layers);

    Mlp mlp;
    mlp.n_layer = llama_model_n_layer(model);
    mlp.n_head = llama_model_n_head_kv(model);
    mlp.dk = mlp.dv = llama_model_n_embd(model) / llama_model_n_head(model);
    mlp.a_log = float(std::log1p(double(llama_model_n_ctx_train(model))));
    mlp.a_lin = float(llama_model_n_ctx_train(model));
    mlp.randomize(42);

    std::mt19937 rng(7);
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    std::vector<llama_token> prompt(size_t(o.n_prompt));
    for (auto& t : prompt) t = llama_token(rng() % uint32_t(n_vocab));

    // --- 1. correctness: in-graph scores against the double MLP on the same decode's K/V ---------------------
    Capture ref;
    ref.mlp = &mlp;
    ref.k.resize(size_t(mlp.n_layer)), ref.v.resize(size_t(mlp.n_layer));
    const std::vector<llama_token> check_tokens(prompt.begin(), prompt.begin() + std::min(o.n_prompt, 256));
    llama_context* ctx = make_context(model, o, Mode::graph, &ref, true);
    mlp.upload(ctx);
    check::decode_tokens(ctx, check_tokens, 0);
    double max_abs_err = 0, max_abs_ref = 0;
    int64_t n_checked = 0;
    std::vector<float> dumped;
    for (int l = 0; l < mlp.n_layer; ++l) {
        int32_t n = 0;
        const float* got = llama_kvp_scorer_scores(ctx, l, &n);
        if (!got || n != int32_t(check_tokens.size()) || ref.n_tokens != n) {
            std::fprintf(stderr, "layer %d: %d scores for %zu tokens\n", l, n, check_tokens.size());
            return 1;
        }
        dumped.insert(dumped.end(), got, got + size_t(n) * size_t(mlp.n_head));
        for (int t = 0; t < n; ++t)
            for (int h = 0; h < mlp.n_head; ++h) {
                const double want = mlp.score(l, h, &ref.k[l][size_t((t * mlp.n_head + h) * mlp.dk)],
                                              &ref.v[l][size_t((t * mlp.n_head + h) * mlp.dv)], t);
                max_abs_err = std::max(max_abs_err, std::fabs(double(got[t * mlp.n_head + h]) - want));
                max_abs_ref = std::max(max_abs_ref, std::fabs(want));
                ++n_checked;
            }
    }
    llama_free(ctx);
    if (!o.dump_scores.empty()) {
        FILE* f = std::fopen(o.dump_scores.c_str(), "wb");
        if (!f || std::fwrite(dumped.data(), sizeof(float), dumped.size(), f) != dumped.size()) return 1;
        std::fclose(f);
    }
    const double rel_err = max_abs_err / std::max(max_abs_ref, 1e-30);
    const bool scores_ok = rel_err <= 1e-4;
    std::fprintf(stderr, "correctness: %lld scores, max |err| %.3g of max |score| %.3g (relative %.3g): %s\n",
                 (long long)n_checked, max_abs_err, max_abs_ref, rel_err, scores_ok ? "ok" : "FAILED");

    // --- 2. speed ------------------------------------------------------------------------------------------------
    const Mode modes[3] = {Mode::none, Mode::graph, Mode::callback};
    std::vector<double> prefill[3], decode[3];
    for (int r = -1; r < o.repeats; ++r) {  // r = -1: warm-up
        for (int m = 0; m < 3; ++m) {
            Capture cap;
            cap.mlp = &mlp;
            cap.score_on_host = false;  // copies only: the syncs and copies that the callback forces
            cap.k.resize(size_t(mlp.n_layer)), cap.v.resize(size_t(mlp.n_layer));
            llama_context* c = make_context(model, o, modes[m], &cap, false);
            if (modes[m] == Mode::graph) mlp.upload(c);
            auto start = Clock::now();
            check::decode_tokens(c, prompt, 0);
            llama_synchronize(c);
            const double t_prefill = seconds_since(start);
            start = Clock::now();
            for (int i = 0; i < o.n_decode; ++i) {
                cap.first_pos = o.n_prompt + i;
                check::decode_tokens(c, {prompt[size_t(i)]}, o.n_prompt + i);
                if (modes[m] == Mode::graph) {
                    int32_t n = 0;
                    if (!llama_kvp_scorer_scores(c, mlp.n_layer - 1, &n) || n != 1) return 1;  // reads them back
                }
            }
            llama_synchronize(c);
            const double t_decode = seconds_since(start);
            llama_free(c);
            if (r < 0) continue;
            prefill[m].push_back(double(o.n_prompt) / t_prefill);
            decode[m].push_back(1000.0 * t_decode / double(o.n_decode));
        }
    }

    char dev[256] = "cpu";
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t d = ggml_backend_dev_get(i);
        if (ggml_backend_dev_type(d) == GGML_BACKEND_DEVICE_TYPE_GPU && o.n_gpu_layers > 0) {
            std::snprintf(dev, sizeof dev, "%s", ggml_backend_dev_description(d));
            break;
        }
    }
    FILE* f = std::fopen(o.out.c_str(), "w");
    if (!f) return 1;
    std::fprintf(f, "{\n \"device\": \"%s\", \"n_gpu_layers\": %d, \"prompt_tokens\": %d, \"decode_tokens\": %d, "
                    "\"repeats\": %d,\n \"correctness\": {\"scores\": %lld, \"max_abs_err\": %.6g, "
                    "\"max_abs_score\": %.6g, \"relative\": %.6g, \"ok\": %s},\n \"speed\": [\n",
                 dev, o.n_gpu_layers, o.n_prompt, o.n_decode, o.repeats, (long long)n_checked, max_abs_err,
                 max_abs_ref, rel_err, scores_ok ? "true" : "false");
    std::printf("| mode | prefill tok/s | vs none | decode ms/token | vs none | scoring ms/token |\n|---|---|---|---|---|---|\n");
    for (int m = 0; m < 3; ++m) {
        const double p = check::median(prefill[m]), d = check::median(decode[m]);
        const double p0 = check::median(prefill[0]), d0 = check::median(decode[0]);
        std::fprintf(f, "  {\"mode\": \"%s\", \"prefill_tokens_per_second\": %.3f, \"prefill_vs_none\": %.4f, "
                        "\"decode_ms_per_token\": %.4f, \"decode_vs_none\": %.4f, \"scoring_ms_per_token\": %.4f}%s\n",
                     mode_name(modes[m]), p, p / p0, d, d0 / d, d - d0, m < 2 ? "," : "");
        std::printf("| %s | %.1f | %.3f | %.3f | %.3f | %.3f |\n", mode_name(modes[m]), p, p / p0, d, d0 / d, d - d0);
    }
    std::fprintf(f, " ]\n}\n");
    std::fclose(f);
    llama_model_free(model);
    llama_backend_free();
    return scores_ok ? 0 : 1;
}
