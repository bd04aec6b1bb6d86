// K-Norm (kvpress KnormPress, arXiv 2406.11430): keep the keys with the lowest L2 norm, s = -||k||_2, one column per
// (layer, KV head). A norm needs nothing but the token's own key (and RoPE, a rotation, leaves it unchanged), so each
// token is scored once, when its key is captured, and no copy of the cache is kept.
#include "attention.h"

namespace kvp {
namespace {

class KnormPolicy final : public EvictionPolicy {
public:
    explicit KnormPolicy(const ModelIdentity& model) : model_(model) {}

    std::string name() const override { return "knorm"; }
    int n_score_columns() const override { return int(model_.n_layer * model_.n_head_kv); }
    std::vector<int> capture_layers() const override { return policies::all_layers(model_); }

    void score_kv(int layer, const HeadTokenView& k, const HeadTokenView&, const int64_t*, const int64_t*, float* rows,
                  size_t row_stride) override {
        const int64_t first_column = int64_t(layer) * k.n_head;
        for (int64_t t = 0; t < k.n_token; ++t)
            for (int64_t h = 0; h < k.n_head; ++h)
                rows[size_t(t) * row_stride + size_t(first_column + h)] = -policies::l2_norm(k.row(t, h), k.dim);
    }

private:
    const ModelIdentity model_;
};

}  // namespace

std::unique_ptr<EvictionPolicy> make_knorm_policy(const ModelIdentity& model) {
    return std::make_unique<KnormPolicy>(model);
}

}  // namespace kvp
