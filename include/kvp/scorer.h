// The scorer: s = MLP(k, v, position features) for every (token, KV head) of one layer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "kvp/format.h"
#include "kvp/kernels.h"

namespace kvp {

// A [tokens][heads][dim] float32 tensor with byte strides, as ggml lays out Kcur/Vcur (ne0 = dim, ne1 = heads,
// ne2 = tokens). Elements along dim are contiguous.
struct HeadTokenView {
    const float* data = nullptr;
    int64_t dim = 0;
    int64_t n_head = 0;
    int64_t n_token = 0;
    size_t head_stride = 0;   // bytes (ggml nb[1])
    size_t token_stride = 0;  // bytes (ggml nb[2])

    const float* row(int64_t token, int64_t head) const {
        return reinterpret_cast<const float*>(reinterpret_cast<const char*>(data) + token * token_stride +
                                              head * head_stride);
    }
    static HeadTokenView contiguous(const float* data, int64_t n_token, int64_t n_head, int64_t dim) {
        return {data, dim, n_head, n_token, size_t(dim) * sizeof(float), size_t(dim * n_head) * sizeof(float)};
    }
};

class Scorer {
public:
    // n_threads <= 0: OpenMP's default. Weights are packed once here; scoring allocates nothing.
    Scorer(std::shared_ptr<const Policy> policy, const KernelSet& kernels, int n_threads = 0);

    const Policy& policy() const { return *policy_; }
    const KernelSet& kernels() const { return *kernels_; }
    int n_threads() const { return n_threads_; }
    bool layer_scored(int layer) const;

    // out[t * n_head_kv + h] = score of token t, KV head h. Throws std::invalid_argument on shape mismatch.
    void score_layer(int layer, const HeadTokenView& k, const HeadTokenView& v, const int64_t* positions,
                     float* out) const;

    // Multiply-adds counted as 2 FLOPs, over every scored (layer, head): the per-token cost of the policy.
    double flops_per_token() const;

    static constexpr int kTokenBlock = 32;

private:
    struct PackedAgent {
        std::vector<float> shift, scale;
        std::vector<std::vector<float>> hidden_w_t;  // n_in x n_out per hidden layer
        std::vector<std::vector<float>> hidden_b;
        std::vector<float> out_w;                    // last layer, n_in
        float out_b = 0.0f;
    };
    void score_block(const PackedAgent& agent, const HeadTokenView& k, const HeadTokenView& v,
                     const int64_t* positions, int head, int64_t t0, int n, float* scratch, float* out) const;

    std::shared_ptr<const Policy> policy_;
    const KernelSet* kernels_;
    int n_threads_;
    std::vector<PackedAgent> packed_;  // n_layer * n_head_kv, empty for unscored layers
    size_t scratch_floats_ = 0;
    mutable std::vector<std::vector<float>> scratch_;  // one buffer per thread
};

}  // namespace kvp
