// KeyDiff (kvpress KeyDiffPress, arXiv 2504.15364): keep the keys least similar to the mean key. Per (layer, KV head),
// the anchor is a = mean over the cached tokens of k_i / ||k_i||, and s_i = -cos(k_i, a). The anchor moves with the
// cache, so every cached token is re-scored right before each eviction, from a host copy of the cached keys. In
// per-head mode each head's anchor is the mean over the tokens that head holds, and only those are scored.
#include "attention.h"

namespace kvp {
namespace {

// The zero-vector guards of torch's F.normalize (eps 1e-12) and cosine similarity (eps 1e-8) that kvpress relies on.
constexpr float kNormalizeEps = 1e-12f;
constexpr float kCosineEps = 1e-8f;

class KeyDiffPolicy final : public policies::CachedKVPolicy {
public:
    explicit KeyDiffPolicy(const ModelIdentity& model) : CachedKVPolicy(model, false) {}

    std::string name() const override { return "keydiff"; }

    void refresh_scores(Ledger& ledger) override {
        if (ledger.n_holders() > 0) return refresh_per_head(ledger);
        const int64_t dim = model_.head_dim_k;
        std::vector<float> anchor(static_cast<size_t>(dim));
        for (int layer = 0; layer < int(model_.n_layer); ++layer) {
            const policies::TokenRows& keys = keys_[size_t(layer)];
            if (keys.size() == 0) continue;
            const std::vector<int64_t> rows = keys.rows_of(ledger);
            for (int64_t g = 0; g < int64_t(model_.n_head_kv); ++g) {
                std::fill(anchor.begin(), anchor.end(), 0.0f);
                for (size_t r = 0; r < keys.size(); ++r) {
                    const float* k = keys.row(r) + g * dim;
                    const float inverse_norm = 1.0f / std::max(policies::l2_norm(k, dim), kNormalizeEps);
                    for (int64_t c = 0; c < dim; ++c) anchor[size_t(c)] += k[c] * inverse_norm;
                }
                for (float& x : anchor) x /= float(keys.size());
                const float anchor_norm = policies::l2_norm(anchor.data(), dim);
                for (size_t i = 0; i < ledger.size(); ++i) {
                    if (rows[i] < 0) continue;
                    const float* k = keys.row(size_t(rows[i])) + g * dim;
                    const float denominator = std::max(policies::l2_norm(k, dim) * anchor_norm, kCosineEps);
                    ledger.scores(i)[column(layer, g)] = -policies::dot(k, anchor.data(), dim) / denominator;
                }
            }
        }
    }

private:
    void refresh_per_head(Ledger& ledger) {
        const int64_t dim = model_.head_dim_k;
        std::vector<float> anchor(static_cast<size_t>(dim));
        for (int layer = 0; layer < int(model_.n_layer); ++layer) {
            const policies::TokenRows& keys = keys_[size_t(layer)];
            if (keys.size() == 0) continue;
            const std::vector<int64_t> rows = keys.rows_of(ledger);
            for (int64_t g = 0; g < int64_t(model_.n_head_kv); ++g) {
                const int head = column(layer, g);  // the per-head cache's (layer, KV head), layer-major like columns
                std::fill(anchor.begin(), anchor.end(), 0.0f);
                size_t held = 0;
                for (size_t i = 0; i < ledger.size(); ++i) {
                    if (rows[i] < 0 || !ledger.held(i, head)) continue;
                    const float* k = keys.row(size_t(rows[i])) + g * dim;
                    const float inverse_norm = 1.0f / std::max(policies::l2_norm(k, dim), kNormalizeEps);
                    for (int64_t c = 0; c < dim; ++c) anchor[size_t(c)] += k[c] * inverse_norm;
                    ++held;
                }
                if (held == 0) continue;
                for (float& x : anchor) x /= float(held);
                const float anchor_norm = policies::l2_norm(anchor.data(), dim);
                for (size_t i = 0; i < ledger.size(); ++i) {
                    if (rows[i] < 0 || !ledger.held(i, head)) continue;
                    const float* k = keys.row(size_t(rows[i])) + g * dim;
                    const float denominator = std::max(policies::l2_norm(k, dim) * anchor_norm, kCosineEps);
                    ledger.scores(i)[head] = -policies::dot(k, anchor.data(), dim) / denominator;
                }
            }
        }
    }
};

}  // namespace

std::unique_ptr<EvictionPolicy> make_keydiff_policy(const ModelIdentity& model) {
    return std::make_unique<KeyDiffPolicy>(model);
}

}  // namespace kvp
