// SnapKV (kvpress SnapKVPress, arXiv 2404.14469): keep the tokens an observation window of recent queries attends to.
// Per layer, the window is the newest kWindow queries seen since the last eviction (fewer if fewer were seen). Each
// attends over every cached key up to it (llama.cpp's causal softmax); the weights on the tokens older than the window
// are averaged over the window's queries, average-pooled along the cached tokens (kernel kKernel, stride 1, zero
// padding kKernel / 2 counted in the mean, as F.avg_pool1d), then averaged over the query heads of each KV head's GQA
// group: one column per (layer, KV head). The window's own tokens score the layer's maximum + 1.
#include "attention.h"

namespace kvp {
namespace {

constexpr size_t kWindow = 64;
constexpr int64_t kKernel = 5;

class SnapKVPolicy final : public policies::AttentionPolicy {
public:
    SnapKVPolicy(const ModelIdentity& model, const PolicyOptions& options) : AttentionPolicy(model, options, kWindow) {}

    std::string name() const override { return "snapkv"; }

    void refresh_scores(Ledger& ledger) override {
        for (int layer = 0; layer < int(model_.n_layer); ++layer) {
            const policies::TokenRows& queries = queries_[size_t(layer)];
            if (queries.size() == 0) continue;
            const policies::TokenRows& keys = keys_[size_t(layer)];
            const size_t n_old = keys.count_through(queries.logical(0) - 1);  // cached tokens before the window
            const std::vector<float> scores = group_scores(layer, n_old);
            const float peak = scores.empty() ? 0.0f : *std::max_element(scores.begin(), scores.end());
            const std::vector<int64_t> rows = keys.rows_of(ledger);
            for (size_t i = 0; i < ledger.size(); ++i) {
                if (rows[i] < 0) continue;
                const size_t j = size_t(rows[i]);
                for (int64_t g = 0; g < shape_.n_head_kv; ++g)
                    ledger.scores(i)[column(layer, g)] = j < n_old ? scores[size_t(g) * n_old + j] : peak + 1.0f;
            }
        }
        clear_queries();
    }

private:
    // scores[g * n_old + j]: the pooled window attention on cached token j, averaged over KV head g's query group.
    std::vector<float> group_scores(int layer, size_t n_old) const {
        const size_t n_queries = queries_[size_t(layer)].size();
        std::vector<float> window_sum(size_t(shape_.n_head) * n_old, 0.0f);
        attend(layer, 0, n_queries, [&](size_t, int64_t head, const float* probs, size_t n_keys) {
            float* sum = window_sum.data() + size_t(head) * n_old;
            for (size_t j = 0; j < std::min(n_keys, n_old); ++j) sum[j] += probs[j];
        });
        std::vector<float> scores(size_t(shape_.n_head_kv) * n_old, 0.0f);
        const float per_head = 1.0f / (float(n_queries) * float(kKernel) * float(shape_.group()));
        for (int64_t h = 0; h < shape_.n_head; ++h) {
            const float* sum = window_sum.data() + size_t(h) * n_old;
            float* out = scores.data() + size_t(h / shape_.group()) * n_old;
            for (size_t j = 0; j < n_old; ++j) {
                const size_t lo = j >= size_t(kKernel / 2) ? j - size_t(kKernel / 2) : 0;
                const size_t hi = std::min(n_old, j + size_t(kKernel / 2) + 1);
                float pooled = 0.0f;
                for (size_t w = lo; w < hi; ++w) pooled += sum[w];
                out[j] += pooled * per_head;
            }
        }
        return scores;
    }
};

}  // namespace

std::unique_ptr<EvictionPolicy> make_snapkv_policy(const ModelIdentity& model, const PolicyOptions& options) {
    return std::make_unique<SnapKVPolicy>(model, options);
}

}  // namespace kvp
