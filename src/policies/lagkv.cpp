// LagKV (kvpress LagKVPress, arXiv 2504.04704): each partition of kLag cached tokens is judged against the next one.
// Per (layer, KV head), over the cached tokens in order: the first kSink score 1; the tokens after them are cut into
// P = (n - kSink) / kLag full partitions (the rest is a remainder). Every token of partition p < P - 1 is min-max
// normalised per channel with the min and max of partition p + 1, its raw score is the standard deviation over the
// channels (unbiased, as torch.std), and a softmax runs over the partition; this is done for keys and for values and
// the two are averaged. The average is replaced by its rank within the partition / kLag (cross_scoring = False).
// The last full partition and the remainder score 1. A cache shorter than kSink + 2 kLag is ranked by recency:
// token j >= kSink scores (j - kSink) / (n - kSink).
// Guard: a channel whose max equals its min in the reference partition (kvpress divides by zero there) contributes 0
// for every token of the partition, as if every value sat at the reference minimum.
// Partitions follow the cache, so every cached token is re-scored right before each eviction from host copies of
// the cached keys and values.
#include <numeric>

#include "attention.h"

namespace kvp {
namespace {

constexpr int64_t kSink = 4;   // kvpress n_sink
constexpr int64_t kLag = 128;  // kvpress lag_size

// Softmax over each partition p < n_partitions - 1 of the std over channels of its tokens, min-max normalised by
// partition p + 1. `token_rows[t]` is the row of token t (after the sinks) in `states`; channels start at `offset`.
std::vector<double> lag_relative_scores(const policies::TokenRows& states, const std::vector<size_t>& token_rows,
                                        int64_t n_partitions, int64_t offset, int64_t dim) {
    std::vector<double> scores(size_t((n_partitions - 1) * kLag));
    std::vector<float> low(static_cast<size_t>(dim)), high(static_cast<size_t>(dim));
    for (int64_t p = 0; p + 1 < n_partitions; ++p) {
        std::fill(low.begin(), low.end(), INFINITY);
        std::fill(high.begin(), high.end(), -INFINITY);
        for (int64_t t = (p + 1) * kLag; t < (p + 2) * kLag; ++t) {
            const float* x = states.row(token_rows[size_t(t)]) + offset;
            for (int64_t c = 0; c < dim; ++c) {
                low[size_t(c)] = std::min(low[size_t(c)], x[c]);
                high[size_t(c)] = std::max(high[size_t(c)], x[c]);
            }
        }
        double* partition = scores.data() + p * kLag;
        double peak = -INFINITY;
        for (int64_t t = 0; t < kLag; ++t) {
            const float* x = states.row(token_rows[size_t(p * kLag + t)]) + offset;
            double sum = 0.0, sum_sq = 0.0;
            for (int64_t c = 0; c < dim; ++c) {
                const double range = double(high[size_t(c)]) - double(low[size_t(c)]);
                const double normalised = range > 0.0 ? (double(x[c]) - double(low[size_t(c)])) / range : 0.0;
                sum += normalised;
                sum_sq += normalised * normalised;
            }
            const double mean = sum / double(dim);
            const double variance = std::max(0.0, (sum_sq - double(dim) * mean * mean) / double(std::max<int64_t>(dim - 1, 1)));
            partition[t] = std::sqrt(variance);
            peak = std::max(peak, partition[t]);
        }
        double total = 0.0;
        for (int64_t t = 0; t < kLag; ++t) total += (partition[t] = std::exp(partition[t] - peak));
        for (int64_t t = 0; t < kLag; ++t) partition[t] /= total;
    }
    return scores;
}

class LagKVPolicy final : public policies::CachedKVPolicy {
public:
    explicit LagKVPolicy(const ModelIdentity& model) : CachedKVPolicy(model, true) {}

    std::string name() const override { return "lagkv"; }

    void refresh_scores(Ledger& ledger) override {
        for (int layer = 0; layer < int(model_.n_layer); ++layer) {
            const std::vector<int64_t> rows = keys_[size_t(layer)].rows_of(ledger);
            std::vector<size_t> entries, token_rows;  // the ledger entries with stored K/V, and their rows
            for (size_t i = 0; i < ledger.size(); ++i)
                if (rows[i] >= 0) entries.push_back(i), token_rows.push_back(size_t(rows[i]));
            for (int64_t g = 0; g < int64_t(model_.n_head_kv); ++g) {
                const std::vector<float> scores = head_scores(layer, g, token_rows);
                for (size_t t = 0; t < entries.size(); ++t) ledger.scores(entries[t])[column(layer, g)] = scores[t];
            }
        }
    }

private:
    std::vector<float> head_scores(int layer, int64_t kv_head, const std::vector<size_t>& token_rows) const {
        const int64_t n = int64_t(token_rows.size());
        std::vector<float> scores(size_t(n), 1.0f);
        if (n < kSink + 2 * kLag) {
            for (int64_t j = kSink; j < n; ++j) scores[size_t(j)] = float(j - kSink) / float(n - kSink);
            return scores;
        }
        const int64_t n_partitions = (n - kSink) / kLag;
        const std::vector<size_t> partitioned(token_rows.begin() + kSink, token_rows.end());
        const int64_t dim_k = model_.head_dim_k, dim_v = model_.head_dim_v;
        const std::vector<double> key_scores =
            lag_relative_scores(keys_[size_t(layer)], partitioned, n_partitions, kv_head * dim_k, dim_k);
        const std::vector<double> value_scores =
            lag_relative_scores(values_[size_t(layer)], partitioned, n_partitions, kv_head * dim_v, dim_v);
        std::vector<size_t> order(static_cast<size_t>(kLag));
        for (int64_t p = 0; p + 1 < n_partitions; ++p) {
            const size_t first = size_t(p * kLag);
            auto combined = [&](size_t t) { return (key_scores[first + t] + value_scores[first + t]) / 2.0; };
            std::iota(order.begin(), order.end(), size_t(0));
            std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return combined(a) < combined(b); });
            for (int64_t rank = 0; rank < kLag; ++rank)
                scores[size_t(kSink) + first + order[size_t(rank)]] = float(rank) / float(kLag);
        }
        return scores;
    }
};

}  // namespace

std::unique_ptr<EvictionPolicy> make_lagkv_policy(const ModelIdentity& model) {
    return std::make_unique<LagKVPolicy>(model);
}

}  // namespace kvp
