// TOVA (kvpress TOVAPress; Oren et al. 2024): keep the tokens the last query attends to most. Per layer, the newest
// query seen since the last eviction attends over every cached key up to it (softmax(q k / sqrt(d)), llama.cpp's
// attention), the weights are averaged over all query heads, and that one score serves every KV head (one column per
// layer). The query's own token scores the layer's maximum + 1, as kvpress pads it.
#include "attention.h"

namespace kvp {
namespace {

class TovaPolicy final : public policies::AttentionPolicy {
public:
    TovaPolicy(const ModelIdentity& model, const PolicyOptions& options) : AttentionPolicy(model, options, 1) {}

    std::string name() const override { return "tova"; }
    int n_score_columns() const override { return int(model_.n_layer); }

    void refresh_scores(Ledger& ledger) override {
        std::vector<float> per_head;
        for (int layer = 0; layer < int(model_.n_layer); ++layer) {
            const policies::TokenRows& queries = queries_[size_t(layer)];
            const policies::TokenRows& keys = keys_[size_t(layer)];
            if (queries.size() == 0) continue;
            const int64_t last = queries.logical(0);
            const size_t n_keys = keys.count_through(last);
            per_head.assign(size_t(shape_.n_head) * n_keys, 0.0f);
            attend(layer, 0, 1, [&](size_t, int64_t head, const float* probs, size_t n) {
                std::copy_n(probs, n, per_head.data() + size_t(head) * n_keys);
            });
            std::vector<float> mean(n_keys, 0.0f);
            float peak = 0.0f;
            for (size_t j = 0; j < n_keys; ++j) {
                for (int64_t h = 0; h < shape_.n_head; ++h) mean[j] += per_head[size_t(h) * n_keys + j];
                mean[j] /= float(shape_.n_head);
                if (keys.logical(j) != last) peak = std::max(peak, mean[j]);
            }
            const std::vector<int64_t> rows = keys.rows_of(ledger);
            for (size_t i = 0; i < ledger.size(); ++i) {
                if (rows[i] < 0 || size_t(rows[i]) >= n_keys) continue;
                const size_t j = size_t(rows[i]);
                ledger.scores(i)[layer] = keys.logical(j) == last ? peak + 1.0f : mean[j];
            }
        }
        clear_queries();
    }
};

}  // namespace

std::unique_ptr<EvictionPolicy> make_tova_policy(const ModelIdentity& model, const PolicyOptions& options) {
    return std::make_unique<TovaPolicy>(model, options);
}

}  // namespace kvp
