#include "graph_scorer.h"

#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

#include "llama.h"
#include "llama_symbol.h"

namespace kvp {

namespace {

// Null members where the loaded libllama lacks a function.
GraphScorer::Functions lookup() {
    GraphScorer::Functions f{};
    f.init = reinterpret_cast<decltype(f.init)>(kvp_symbol("llama_kvp_scorer_init"));
    f.set_layer = reinterpret_cast<decltype(f.set_layer)>(kvp_symbol("llama_kvp_scorer_set_layer"));
    f.set_pos_offset = reinterpret_cast<decltype(f.set_pos_offset)>(kvp_symbol("llama_kvp_scorer_set_pos_offset"));
    f.scores = reinterpret_cast<decltype(f.scores)>(kvp_symbol("llama_kvp_scorer_scores"));
    return f;
}

bool complete(const GraphScorer::Functions& f) { return f.init && f.set_layer && f.set_pos_offset && f.scores; }

// Which policy's MLP each context runs: kvp-bench attaches several engines to one context, and they share the one
// scorer only when they share the policy file.
std::mutex registry_mutex;
std::map<const llama_context*, const Policy*> uploaded_to;

}  // namespace

bool GraphScorer::available() { return complete(lookup()); }

GraphScorer::GraphScorer(const Policy& policy) : policy_(policy), fn_(lookup()) {
    if (!complete(fn_))
        throw std::runtime_error("in-graph scoring needs the patched llama.cpp (llama_kvp_scorer_*), and this "
                                 "process loaded the stock one");
    for (uint32_t layer = 0; layer < policy.identity.n_layer; ++layer)
        if (policy.layer_scored[layer]) layers_.push_back(int(layer));
}

void GraphScorer::upload(llama_context* ctx) {
    const Functions& f = fn_;
    const Policy& p = policy_;
    const uint32_t n_head = p.identity.n_head_kv;
    std::vector<int32_t> widths{int32_t(p.input_dim())};
    for (uint32_t width : p.hidden) widths.push_back(int32_t(width));
    widths.push_back(1);
    std::vector<int32_t> kinds;
    std::vector<float> a;
    for (const PosFeature& feature : p.pos_features) {
        kinds.push_back(int32_t(feature.kind));  // PosFeatureKind and Activation use llama.h's LLAMA_KVP_* values
        a.push_back(feature.a);
    }
    const int32_t n_dense = int32_t(widths.size()) - 1;
    if (f.init(ctx, n_dense, widths.data(), int32_t(p.activation), int32_t(kinds.size()), kinds.data(), a.data()) != 0)
        throw std::runtime_error("llama_kvp_scorer_init refused the policy's MLP; see llama.cpp's log");

    // head-major copies: [head][...] per tensor
    std::vector<float> shift, scale;
    std::vector<std::vector<float>> weights(n_dense), biases(n_dense);
    for (int layer : layers_) {
        shift.clear(), scale.clear();
        for (auto& w : weights) w.clear();
        for (auto& b : biases) b.clear();
        for (uint32_t head = 0; head < n_head; ++head) {
            const Agent& agent = p.agent(uint32_t(layer), head);
            shift.insert(shift.end(), agent.shift.begin(), agent.shift.end());
            scale.insert(scale.end(), agent.scale.begin(), agent.scale.end());
            for (int i = 0; i < n_dense; ++i) {
                weights[i].insert(weights[i].end(), agent.dense[i].weight.begin(), agent.dense[i].weight.end());
                biases[i].insert(biases[i].end(), agent.dense[i].bias.begin(), agent.dense[i].bias.end());
            }
        }
        std::vector<const float*> w_ptr, b_ptr;
        for (int i = 0; i < n_dense; ++i) w_ptr.push_back(weights[i].data()), b_ptr.push_back(biases[i].data());
        if (f.set_layer(ctx, layer, shift.data(), scale.data(), w_ptr.data(), b_ptr.data()) != 0)
            throw std::runtime_error("llama_kvp_scorer_set_layer failed for layer " + std::to_string(layer) +
                                     "; see llama.cpp's log");
    }
    std::lock_guard<std::mutex> lock(registry_mutex);
    uploaded_to[ctx] = &policy_;
}

bool GraphScorer::current(llama_context* ctx) const {
    std::lock_guard<std::mutex> lock(registry_mutex);
    const auto it = uploaded_to.find(ctx);
    return it != uploaded_to.end() && it->second == &policy_;
}

void GraphScorer::set_pos_offset(llama_context* ctx, int64_t offset) const {
    fn_.set_pos_offset(ctx, llama_pos(offset));
}

const float* GraphScorer::scores(llama_context* ctx, int layer, int64_t* n_tokens) const {
    int32_t n = 0;
    const float* out = fn_.scores(ctx, layer, &n);
    *n_tokens = n;
    return out;
}

}  // namespace kvp
