// KVP: the learned per-(layer, KV head) MLP of a kvp.bin file, one score column per scored (layer, head).
#include <memory>
#include <string>
#include <vector>

#include "kvp/policy.h"

namespace kvp {
namespace {

class LearnedPolicy final : public EvictionPolicy {
public:
    LearnedPolicy(std::shared_ptr<const Policy> file, const KernelSet& kernels, int n_threads)
        : file_(file),
          scorer_(file, kernels, n_threads),
          n_head_(int(file->identity.n_head_kv)),
          default_sink_(file->n_sink),
          default_recent_(file->n_recent) {
        column_of_layer_.assign(file->identity.n_layer, -1);
        for (uint32_t layer = 0; layer < file->identity.n_layer; ++layer) {
            if (!file->layer_scored[layer]) continue;
            column_of_layer_[layer] = int(layers_.size()) * n_head_;
            layers_.push_back(int(layer));
        }
    }

    std::string name() const override { return "kvp"; }
    int n_score_columns() const override { return int(layers_.size()) * n_head_; }
    std::vector<int> score_layers() const override { return layers_; }
    std::vector<int> capture_layers() const override { return layers_; }
    uint32_t default_sink() const override { return default_sink_; }
    uint32_t default_recent() const override { return default_recent_; }

    void score_kv(int layer, const HeadTokenView& k, const HeadTokenView& v, const int64_t* original_pos,
                  const int64_t*, float* rows, size_t row_stride) override {
        const int64_t n = k.n_token;
        scratch_.resize(size_t(n) * n_head_);
        scorer_.score_layer(layer, k, v, original_pos, scratch_.data());
        store_scores(layer, scratch_.data(), n, rows, row_stride);
    }

    bool has_recency_terms() const override { return file_->n_recency_knots > 0; }

    void add_recency_terms(Ledger& ranking, int64_t next_position) const override {
        const uint32_t knots = file_->n_recency_knots;
        if (knots == 0) return;
        for (size_t i = 0; i < ranking.size(); ++i) {
            const int64_t age = next_position - ranking.original_pos(i);
            float* row = ranking.scores(i);
            for (size_t slot = 0; slot < layers_.size(); ++slot)
                for (int h = 0; h < n_head_; ++h) {
                    float& score = row[slot * size_t(n_head_) + size_t(h)];
                    const double term = recency_term(file_->agent(uint32_t(layers_[slot]), uint32_t(h)).recency.data(), knots, age);
                    score = float(double(score) + term);
                }
        }
    }

    const Policy* graph_scorer() const override { return file_.get(); }

    void store_graph_scores(int layer, const float* scores, int64_t n, float* rows, size_t row_stride) override {
        store_scores(layer, scores, n, rows, row_stride);
    }

private:
    // scores [n][n_head_kv] of one layer -> that layer's columns of the rows
    void store_scores(int layer, const float* scores, int64_t n, float* rows, size_t row_stride) const {
        const int column = column_of_layer_.at(layer);
        for (int64_t t = 0; t < n; ++t)
            for (int h = 0; h < n_head_; ++h) rows[t * row_stride + column + h] = scores[t * n_head_ + h];
    }

    std::shared_ptr<const Policy> file_;
    Scorer scorer_;
    int n_head_;
    uint32_t default_sink_, default_recent_;
    std::vector<int> layers_;
    std::vector<int> column_of_layer_;
    std::vector<float> scratch_;  // grows to the largest ubatch once
};

}  // namespace

std::unique_ptr<EvictionPolicy> make_learned_policy(std::shared_ptr<const Policy> file, const PolicyOptions& options) {
    const KernelSet& kernels = options.kernel == "auto" ? select_kernels() : kernels_by_name(options.kernel);
    return std::make_unique<LearnedPolicy>(std::move(file), kernels, options.n_threads);
}

}  // namespace kvp
