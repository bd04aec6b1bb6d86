// Shared pieces of the baseline policies whose scores depend on the whole cache: host copies of the post-RoPE keys
// (and values, queries) of cached tokens, keyed by logical index, and llama.cpp's attention recomputed from them.
// Internal to src/policies.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvp/policy.h"

namespace kvp::policies {

inline std::vector<int> all_layers(const ModelIdentity& model) {
    std::vector<int> layers(model.n_layer);
    for (uint32_t l = 0; l < model.n_layer; ++l) layers[l] = int(l);
    return layers;
}

inline float dot(const float* a, const float* b, int64_t n) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
    return sum;
}

inline float l2_norm(const float* a, int64_t n) { return std::sqrt(dot(a, a, n)); }

// One row of `width` floats per token, in ascending logical order (the order the hook delivers tokens in).
class TokenRows {
public:
    size_t size() const { return logical_.size(); }
    int64_t width() const { return width_; }
    int64_t logical(size_t i) const { return logical_[i]; }
    const float* row(size_t i) const { return data_.data() + i * size_t(width_); }
    float* row(size_t i) { return data_.data() + i * size_t(width_); }
    size_t bytes() const { return data_.size() * sizeof(float) + logical_.size() * sizeof(int64_t); }

    // One row per token of `view`: its heads side by side, n_head * dim floats.
    void append(const HeadTokenView& view, const int64_t* logical) {
        set_width(view.n_head * view.dim);
        for (int64_t t = 0; t < view.n_token; ++t) {
            push_logical(logical[t]);
            for (int64_t h = 0; h < view.n_head; ++h) data_.insert(data_.end(), view.row(t, h), view.row(t, h) + view.dim);
        }
    }

    void append_zeros(int64_t logical, int64_t width) {
        set_width(width);
        push_logical(logical);
        data_.resize(data_.size() + size_t(width), 0.0f);
    }

    // Drops the rows whose logical index is listed (ascending); others are ignored.
    void forget(const std::vector<int64_t>& sorted_logical) {
        size_t kept = 0, g = 0;
        for (size_t i = 0; i < size(); ++i) {
            while (g < sorted_logical.size() && sorted_logical[g] < logical_[i]) ++g;
            if (g < sorted_logical.size() && sorted_logical[g] == logical_[i]) continue;
            if (kept != i) {
                logical_[kept] = logical_[i];
                std::copy_n(row(i), width_, row(kept));
            }
            ++kept;
        }
        truncate(kept);
    }

    void drop_first(size_t n) {
        n = std::min(n, size());
        logical_.erase(logical_.begin(), logical_.begin() + ptrdiff_t(n));
        data_.erase(data_.begin(), data_.begin() + ptrdiff_t(n * size_t(width_)));
    }

    void clear() { truncate(0); }
    void fill_zero() { std::fill(data_.begin(), data_.end(), 0.0f); }

    // The number of rows with logical index <= `logical`; they come first.
    size_t count_through(int64_t logical) const {
        return size_t(std::upper_bound(logical_.begin(), logical_.end(), logical) - logical_.begin());
    }

    // The row of each ledger entry, or -1 for a token these rows never saw (one restored by load_state).
    std::vector<int64_t> rows_of(const Ledger& ledger) const {
        std::vector<int64_t> rows(ledger.size(), -1);
        size_t r = 0;
        for (size_t i = 0; i < ledger.size(); ++i) {
            while (r < size() && logical_[r] < ledger.logical(i)) ++r;
            if (r < size() && logical_[r] == ledger.logical(i)) rows[i] = int64_t(r);
        }
        return rows;
    }

private:
    void truncate(size_t n) {
        logical_.resize(n);
        data_.resize(n * size_t(width_));
    }
    void set_width(int64_t width) {
        if (size() == 0) width_ = width;
        if (width != width_)
            throw std::invalid_argument("captured rows changed width from " + std::to_string(width_) + " to " +
                                        std::to_string(width));
    }
    void push_logical(int64_t logical) {
        if (size() > 0 && logical <= logical_.back())
            throw std::logic_error("token " + std::to_string(logical) + " arrived after token " +
                                   std::to_string(logical_.back()));
        logical_.push_back(logical);
    }

    int64_t width_ = 0;
    std::vector<int64_t> logical_;
    std::vector<float> data_;
};

struct AttentionShape {
    int64_t n_head = 0;  // query heads; 0 until the first query is seen
    int64_t n_head_kv = 0;
    int64_t head_dim = 0;
    int64_t group() const { return n_head / n_head_kv; }
};

// probs[j] = softmax over j < n_keys of (q . k_j) / sqrt(head_dim), for query head `head` of `query` (n_head *
// head_dim floats) over the KV head head / group of the key rows, as llama.cpp broadcasts K over query heads.
inline void attention_row(const float* query, int64_t head, const TokenRows& keys, size_t n_keys,
                          const AttentionShape& shape, float* probs) {
    const int64_t dim = shape.head_dim;
    const float* q = query + head * dim;
    const int64_t kv_offset = (head / shape.group()) * dim;
    const float scale = 1.0f / std::sqrt(float(dim));
    float peak = -INFINITY;
    for (size_t j = 0; j < n_keys; ++j) {
        probs[j] = scale * dot(q, keys.row(j) + kv_offset, dim);
        peak = std::max(peak, probs[j]);
    }
    double total = 0.0;
    for (size_t j = 0; j < n_keys; ++j) total += (probs[j] = std::exp(probs[j] - peak));
    const float inverse = float(1.0 / total);  // total >= 1: the peak contributes exp(0)
    for (size_t j = 0; j < n_keys; ++j) probs[j] *= inverse;
}

// Calls visit(query_row, head, probs, n_keys) for every query head of query rows [first, last), with that head's
// attention over the keys the causal mask lets the query see (logical index <= its own), keys.row(j) for j < n_keys.
// Heads run in parallel, so `visit` may only write state that belongs to its head.
template <class Visit>
void for_each_attention(const TokenRows& queries, size_t first, size_t last, const TokenRows& keys,
                        const AttentionShape& shape, int n_threads, Visit&& visit) {
    const double work = double(last - first) * double(keys.size()) * double(shape.n_head * shape.head_dim);
    const int threads = n_threads > 0 ? n_threads : omp_get_max_threads();
    // A decode step (one query over a budget of keys) is cheaper than waking the threads.
#pragma omp parallel num_threads(threads) if (work > 1e6)
    {
        std::vector<float> probs(keys.size());
#pragma omp for schedule(static)
        for (int64_t head = 0; head < shape.n_head; ++head)
            for (size_t i = first; i < last; ++i) {
                const size_t n_keys = keys.count_through(queries.logical(i));
                attention_row(queries.row(i), head, keys, n_keys, shape, probs.data());
                visit(i, head, static_cast<const float*>(probs.data()), n_keys);
            }
    }
}

// A policy that keeps a host copy of the post-RoPE keys (and, if asked, values) of every cached token of every layer,
// because its scores depend on the whole cache and are rewritten in refresh_scores. Score columns are
// layer * n_head_kv + KV head unless a subclass says otherwise. The copies are dropped as tokens leave the cache.
class CachedKVPolicy : public EvictionPolicy {
public:
    CachedKVPolicy(const ModelIdentity& model, bool keep_values)
        : model_(model), keys_(model.n_layer), values_(keep_values ? model.n_layer : 0) {}

    int n_score_columns() const override { return int(model_.n_layer * model_.n_head_kv); }
    std::vector<int> capture_layers() const override { return all_layers(model_); }

    void score_kv(int layer, const HeadTokenView& k, const HeadTokenView& v, const int64_t*, const int64_t* logical,
                  float*, size_t) override {
        keys_.at(size_t(layer)).append(k, logical);
        if (!values_.empty()) values_.at(size_t(layer)).append(v, logical);
    }

    void forget(const std::vector<int64_t>& logical) override {
        for (TokenRows& rows : keys_) rows.forget(logical);
        for (TokenRows& rows : values_) rows.forget(logical);
    }

    size_t state_bytes() const override { return bytes_of(keys_) + bytes_of(values_); }

protected:
    static size_t bytes_of(const std::vector<TokenRows>& per_layer) {
        size_t total = 0;
        for (const TokenRows& rows : per_layer) total += rows.bytes();
        return total;
    }
    int column(int layer, int64_t kv_head) const { return layer * int(model_.n_head_kv) + int(kv_head); }

    const ModelIdentity model_;
    std::vector<TokenRows> keys_;    // per layer: n_head_kv * head_dim_k floats per token
    std::vector<TokenRows> values_;  // per layer, or empty when values are not kept
};

// A policy scored from the attention that queries paid to the cached keys. Queries come from Qcur-<layer>
// (post-RoPE); the number of query heads is taken from the first one. At most `query_window` of the newest queries
// are kept per layer (0: no limit; subclasses then consume them as they go).
class AttentionPolicy : public CachedKVPolicy {
public:
    AttentionPolicy(const ModelIdentity& model, const PolicyOptions& options, size_t query_window)
        : CachedKVPolicy(model, false), queries_(model.n_layer), n_threads_(options.n_threads), query_window_(query_window) {}

    std::vector<int> query_layers() const override { return all_layers(model_); }

    void observe_queries(int layer, const HeadTokenView& q, const int64_t*, const int64_t* logical) override {
        learn_shape(q);
        TokenRows& queries = queries_.at(size_t(layer));
        queries.append(q, logical);
        if (query_window_ > 0 && queries.size() > query_window_) queries.drop_first(queries.size() - query_window_);
    }

    void forget(const std::vector<int64_t>& logical) override {
        CachedKVPolicy::forget(logical);
        for (TokenRows& rows : queries_) rows.forget(logical);
    }

    size_t state_bytes() const override { return CachedKVPolicy::state_bytes() + bytes_of(queries_); }

protected:
    template <class Visit>
    void attend(int layer, size_t first, size_t last, Visit&& visit) const {
        for_each_attention(queries_[size_t(layer)], first, last, keys_[size_t(layer)], shape_, n_threads_, visit);
    }
    void clear_queries() {
        for (TokenRows& rows : queries_) rows.clear();
    }

    AttentionShape shape_;
    std::vector<TokenRows> queries_;  // per layer: n_head * head_dim_k floats per query

private:
    void learn_shape(const HeadTokenView& q) {
        if (shape_.n_head == 0) {
            if (q.dim != int64_t(model_.head_dim_k) || q.n_head <= 0 || model_.n_head_kv == 0 ||
                q.n_head % int64_t(model_.n_head_kv) != 0)
                throw std::invalid_argument("queries of " + std::to_string(q.n_head) + " heads of " +
                                            std::to_string(q.dim) + " do not fit " + std::to_string(model_.n_head_kv) +
                                            " KV heads of " + std::to_string(model_.head_dim_k));
            shape_ = {q.n_head, int64_t(model_.n_head_kv), q.dim};
        } else if (q.n_head != shape_.n_head || q.dim != shape_.head_dim) {
            throw std::invalid_argument("the query shape changed between layers or batches");
        }
    }

    int n_threads_;
    size_t query_window_;
};

// Attention received by each cached token, summed over every query absorbed so far (H2O, ObservedAttention). A query
// is absorbed as soon as its own key is stored (llama.cpp computes Qcur before Kcur), so queries never outlive their
// ubatch and a long prefill needs no n x n attention matrix.
class ReceivedAttentionPolicy : public AttentionPolicy {
public:
    ReceivedAttentionPolicy(const ModelIdentity& model, const PolicyOptions& options)
        : AttentionPolicy(model, options, 0), received_(model.n_layer) {}

    void observe_queries(int layer, const HeadTokenView& q, const int64_t* original_pos, const int64_t* logical) override {
        AttentionPolicy::observe_queries(layer, q, original_pos, logical);
        absorb(layer);
    }

    void score_kv(int layer, const HeadTokenView& k, const HeadTokenView& v, const int64_t* original_pos,
                  const int64_t* logical, float* rows, size_t row_stride) override {
        AttentionPolicy::score_kv(layer, k, v, original_pos, logical, rows, row_stride);
        absorb(layer);
    }

    void forget(const std::vector<int64_t>& logical) override {
        AttentionPolicy::forget(logical);
        for (TokenRows& rows : received_) rows.forget(logical);
    }

    size_t state_bytes() const override { return AttentionPolicy::state_bytes() + bytes_of(received_); }

protected:
    // Writes score(received attention per query head, queries counted) into every (layer, KV head) column of the
    // ledger entries this policy holds keys for, where `score` is the mean over the KV head's query group of
    // per_head(sum, count); entries whose count is 0 keep their scores when skip_uncounted.
    template <class PerHead>
    void write_group_means(Ledger& ledger, bool skip_uncounted, PerHead&& per_head) {
        if (shape_.n_head == 0) return;
        for (int layer = 0; layer < int(model_.n_layer); ++layer) {
            TokenRows& received = sync_received(layer);
            const std::vector<int64_t> rows = received.rows_of(ledger);
            for (size_t i = 0; i < ledger.size(); ++i) {
                if (rows[i] < 0) continue;
                const float* sums = received.row(size_t(rows[i]));
                const float count = sums[shape_.n_head];
                if (skip_uncounted && count == 0.0f) continue;
                for (int64_t g = 0; g < shape_.n_head_kv; ++g) {
                    double total = 0.0;
                    for (int64_t h = g * shape_.group(); h < (g + 1) * shape_.group(); ++h) total += per_head(sums[h], count);
                    ledger.scores(i)[column(layer, g)] = float(total / double(shape_.group()));
                }
            }
        }
    }
    void reset_received() {
        for (TokenRows& rows : received_) rows.fill_zero();
    }

private:
    // received_[layer] mirrors keys_[layer] (a prefix of it until synced): per token, the attention it received from
    // each query head, then the number of queries counted.
    TokenRows& sync_received(int layer) {
        const TokenRows& keys = keys_[size_t(layer)];
        TokenRows& received = received_[size_t(layer)];
        while (received.size() < keys.size()) received.append_zeros(keys.logical(received.size()), shape_.n_head + 1);
        return received;
    }

    void absorb(int layer) {
        const TokenRows& keys = keys_[size_t(layer)];
        TokenRows& queries = queries_[size_t(layer)];
        if (keys.size() == 0 || queries.size() == 0) return;
        const size_t ready = queries.count_through(keys.logical(keys.size() - 1));
        if (ready == 0) return;
        TokenRows& received = sync_received(layer);
        const int64_t count_column = shape_.n_head;
        attend(layer, 0, ready, [&](size_t, int64_t head, const float* probs, size_t n_keys) {
            for (size_t j = 0; j < n_keys; ++j) received.row(j)[head] += probs[j];
            if (head == 0)
                for (size_t j = 0; j < n_keys; ++j) received.row(j)[count_column] += 1.0f;
        });
        queries.drop_first(ready);
    }

    std::vector<TokenRows> received_;
};

}  // namespace kvp::policies
