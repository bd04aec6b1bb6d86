#include "kvp/scorer.h"

#include <omp.h>

#include <algorithm>
#include <stdexcept>
#include <string>

namespace kvp {

Scorer::Scorer(std::shared_ptr<const Policy> policy, const KernelSet& kernels, int n_threads)
    : policy_(std::move(policy)), kernels_(&kernels) {
    if (!policy_) throw std::invalid_argument("Scorer needs a policy");
    n_threads_ = n_threads > 0 ? n_threads : omp_get_max_threads();

    const Policy& p = *policy_;
    const size_t input_dim = p.input_dim();
    size_t widest = input_dim;
    for (uint32_t width : p.hidden) widest = std::max<size_t>(widest, width);
    // Two ping-pong activations of kTokenBlock rows at the widest width, plus the position features.
    scratch_floats_ = 2 * size_t(kTokenBlock) * widest + size_t(kTokenBlock) * p.pos_features.size();
    scratch_.assign(n_threads_, std::vector<float>(scratch_floats_));

    packed_.resize(p.agents.size());
    for (size_t i = 0; i < p.agents.size(); ++i) {
        const Agent& agent = p.agents[i];
        if (agent.dense.empty()) continue;
        PackedAgent& packed = packed_[i];
        packed.shift = agent.shift;
        packed.scale = agent.scale;
        for (size_t j = 0; j + 1 < agent.dense.size(); ++j) {
            packed.hidden_w_t.push_back(pack_transposed(agent.dense[j]));
            packed.hidden_b.push_back(agent.dense[j].bias);
        }
        packed.out_w = agent.dense.back().weight;
        packed.out_b = agent.dense.back().bias.at(0);
    }
}

bool Scorer::layer_scored(int layer) const {
    return layer >= 0 && size_t(layer) < policy_->layer_scored.size() && policy_->layer_scored[layer];
}

double Scorer::flops_per_token() const {
    const Policy& p = *policy_;
    double per_agent = 2.0 * p.input_dim();  // normalisation
    uint32_t n_in = p.input_dim();
    for (uint32_t width : p.hidden) {
        per_agent += 2.0 * n_in * width;
        n_in = width;
    }
    per_agent += 2.0 * n_in;
    size_t n_scored_layers = std::count(p.layer_scored.begin(), p.layer_scored.end(), true);
    return per_agent * double(n_scored_layers) * p.identity.n_head_kv;
}

void Scorer::score_block(const PackedAgent& agent, const HeadTokenView& k, const HeadTokenView& v,
                         const int64_t* positions, int head, int64_t t0, int n, float* scratch,
                         float* out) const {
    const Policy& p = *policy_;
    const int dk = int(k.dim), dv = int(v.dim), n_pos = int(p.pos_features.size());
    const int input_dim = dk + dv + n_pos;
    size_t widest = input_dim;
    for (uint32_t width : p.hidden) widest = std::max<size_t>(widest, width);
    float* act_a = scratch;
    float* act_b = scratch + size_t(kTokenBlock) * widest;
    float* pos = act_b + size_t(kTokenBlock) * widest;

    for (int i = 0; i < n; ++i) {
        const int64_t t = t0 + i;
        float* x = act_a + size_t(i) * input_dim;
        std::copy_n(k.row(t, head), dk, x);
        std::copy_n(v.row(t, head), dv, x + dk);
        compute_pos_features(p.pos_features, positions[t], pos + size_t(i) * n_pos);
        std::copy_n(pos + size_t(i) * n_pos, n_pos, x + dk + dv);
        const float* shift = agent.shift.data();
        const float* scale = agent.scale.data();
        for (int d = 0; d < input_dim; ++d) x[d] = (x[d] - shift[d]) * scale[d];
    }

    int n_in = input_dim;
    for (size_t j = 0; j < agent.hidden_w_t.size(); ++j) {
        const int n_out = int(p.hidden[j]);
        kernels_->dense(act_a, n, n_in, agent.hidden_w_t[j].data(), agent.hidden_b[j].data(), n_out,
                        p.activation, true, act_b);
        std::swap(act_a, act_b);
        n_in = n_out;
    }
    float block_scores[kTokenBlock];
    kernels_->dot(act_a, n, n_in, agent.out_w.data(), agent.out_b, block_scores);
    const int n_head = int(p.identity.n_head_kv);
    for (int i = 0; i < n; ++i) out[(t0 + i) * n_head + head] = block_scores[i];
}

void Scorer::score_layer(int layer, const HeadTokenView& k, const HeadTokenView& v, const int64_t* positions,
                         float* out) const {
    const Policy& p = *policy_;
    if (!layer_scored(layer))
        throw std::invalid_argument("layer " + std::to_string(layer) + " has no agents in this policy");
    if (k.dim != p.identity.head_dim_k || v.dim != p.identity.head_dim_v || k.n_head != p.identity.n_head_kv ||
        v.n_head != p.identity.n_head_kv || k.n_token != v.n_token)
        throw std::invalid_argument("K/V shapes do not match the policy's " + p.identity.to_string());
    const int64_t n_token = k.n_token;
    const int n_head = int(p.identity.n_head_kv);
    const int64_t n_blocks = (n_token + kTokenBlock - 1) / kTokenBlock;
    const int64_t n_items = n_blocks * n_head;
    // Waking a second thread costs more than a decode step's few blocks of work (measured: 0.06 ms -> 8 ms per
    // token when the other core is busy), so small calls stay on the calling thread.
    const bool parallel = n_token >= 2 * kTokenBlock && n_threads_ > 1;
    const int n_threads = int(std::min<int64_t>(n_threads_, std::max<int64_t>(n_items, 1)));

#pragma omp parallel for num_threads(n_threads) schedule(static) if (parallel)
    for (int64_t item = 0; item < n_items; ++item) {
        // Head-major: consecutive items reuse one agent's weights while they are hot in cache.
        const int head = int(item / n_blocks);
        const int64_t t0 = (item % n_blocks) * kTokenBlock;
        const int n = int(std::min<int64_t>(kTokenBlock, n_token - t0));
        float* scratch = scratch_[omp_get_thread_num()].data();
        score_block(packed_[size_t(layer) * n_head + head], k, v, positions, head, t0, n, scratch, out);
    }
}

}  // namespace kvp
