// Python bindings of the policy registry and its ranking view: any policy, driven on a standalone ledger exactly as
// the engine drives it (score_positions, observe_queries, score_kv, refresh_scores), ranks a given set of cached
// tokens of one layer, per KV head.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <set>
#include <stdexcept>

#include "bindings_common.h"
#include "kvp/policy.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace kvp {
namespace {

using TokenHeadDim = nb::ndarray<const float, nb::ndim<3>, nb::c_contig, nb::device::cpu>;
using Positions = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

using bindings::identity_from_dict;
using bindings::to_numpy;

HeadTokenView view_of(const TokenHeadDim& a) {
    return HeadTokenView::contiguous(a.data(), int64_t(a.shape(0)), int64_t(a.shape(1)), int64_t(a.shape(2)));
}

void check_shape(const TokenHeadDim& a, const char* what, size_t n_token, size_t n_head, size_t dim) {
    if (a.shape(0) != n_token || (n_head && a.shape(1) != n_head) || a.shape(2) != dim)
        throw std::invalid_argument(std::string(what) + " has shape (" + std::to_string(a.shape(0)) + ", " +
                                    std::to_string(a.shape(1)) + ", " + std::to_string(a.shape(2)) + "), expected (" +
                                    std::to_string(n_token) + ", " + (n_head ? std::to_string(n_head) : "heads") +
                                    ", " + std::to_string(dim) + ")");
}

bool contains(const std::vector<int>& layers, int layer) {
    return std::find(layers.begin(), layers.end(), layer) != layers.end();
}

// The score columns of `layer`, as [first, first + width). Policies lay their columns out layer after layer over the
// layers they capture (K/V or queries), with one column per KV head or one shared by the layer's heads; a policy that
// captures nothing has one token-level column.
std::pair<int, int> layer_columns(const EvictionPolicy& policy, int layer, const ModelIdentity& model) {
    std::set<int> scored;
    for (int l : policy.capture_layers()) scored.insert(l);
    for (int l : policy.query_layers()) scored.insert(l);
    if (!scored.empty() && !scored.count(layer))
        throw std::invalid_argument("policy '" + policy.name() + "' does not score layer " + std::to_string(layer));
    const int n_columns = policy.n_score_columns();
    const int n_groups = scored.empty() ? 1 : int(scored.size());
    const int width = n_columns / n_groups;
    if (width * n_groups != n_columns || (width != 1 && width != int(model.n_head_kv)))
        throw std::logic_error("policy '" + policy.name() + "' has " + std::to_string(n_columns) +
                               " score columns for " + std::to_string(n_groups) + " layer(s)");
    const int index = scored.empty() ? 0 : int(std::distance(scored.begin(), scored.find(layer)));
    return {index * width, width};
}

struct Ranking {
    std::vector<float> scores;     // [kv head][token]
    std::vector<int64_t> ranking;  // [kv head][rank]: token index, most valuable first
    std::vector<int64_t> joint;    // [rank][2]: (kv head, token index) over every head
};

Ranking rank_tokens(const std::string& name, const ModelIdentity& model, int layer, const HeadTokenView& k,
                    const HeadTokenView& v, const std::optional<HeadTokenView>& q, const int64_t* positions,
                    uint32_t n_sink, uint32_t n_recent, uint64_t seed) {
    const int64_t n = k.n_token, n_head = model.n_head_kv;
    PolicyOptions options;
    options.seed = seed;
    std::unique_ptr<EvictionPolicy> policy = make_policy(name, model, options);
    const auto [first_column, width] = layer_columns(*policy, layer, model);

    Ledger ledger(policy->n_score_columns());
    for (int64_t i = 0; i < n; ++i) ledger.append(positions[i], positions[i], i);
    const size_t stride = size_t(ledger.n_columns());
    policy->score_positions(ledger.logical_data(), ledger.original_pos_data(), int(n), ledger.scores(0), stride);
    if (contains(policy->query_layers(), layer)) {
        if (!q) throw std::invalid_argument("policy '" + name + "' needs the queries q");
        const int64_t first = n - q->n_token;
        policy->observe_queries(layer, *q, ledger.original_pos_data() + first, ledger.logical_data() + first);
    }
    if (contains(policy->capture_layers(), layer))
        policy->score_kv(layer, k, v, ledger.original_pos_data(), ledger.logical_data(), ledger.scores(0), stride);
    policy->refresh_scores(ledger);
    if (policy->has_recency_terms() && n > 0)
        policy->add_recency_terms(ledger, *std::max_element(positions, positions + n) + 1);

    Ranking out;
    out.scores.resize(size_t(n_head * n));
    for (int64_t h = 0; h < n_head; ++h)
        for (int64_t t = 0; t < n; ++t)
            out.scores[size_t(h * n + t)] = ledger.scores(size_t(t))[first_column + (width == 1 ? 0 : h)];

    // Protected tokens (as the evictor protects them) come first; then the higher score, the more recent token, the
    // lower head.
    // As in the evictor, a NaN or infinite score is the lowest (and a NaN would break the sort).
    auto sortable = [](float score) { return std::isfinite(score) ? score : -INFINITY; };
    auto is_protected = [&](int64_t t) { return positions[t] < int64_t(n_sink) || t >= n - int64_t(n_recent); };
    auto before = [&](int64_t ha, int64_t a, int64_t hb, int64_t b) {
        const bool pa = is_protected(a), pb = is_protected(b);
        if (pa != pb) return pa;
        const float sa = sortable(out.scores[size_t(ha * n + a)]), sb = sortable(out.scores[size_t(hb * n + b)]);
        if (!pa && sa != sb) return sa > sb;
        if (a != b) return a > b;
        return ha < hb;
    };
    out.ranking.resize(size_t(n_head * n));
    for (int64_t h = 0; h < n_head; ++h) {
        int64_t* order = out.ranking.data() + h * n;
        std::iota(order, order + n, int64_t(0));
        std::sort(order, order + n, [&](int64_t a, int64_t b) { return before(h, a, h, b); });
    }
    std::vector<int64_t> pairs(size_t(n_head * n));
    std::iota(pairs.begin(), pairs.end(), int64_t(0));
    std::sort(pairs.begin(), pairs.end(), [&](int64_t x, int64_t y) { return before(x / n, x % n, y / n, y % n); });
    out.joint.reserve(2 * pairs.size());
    for (int64_t pair : pairs) out.joint.insert(out.joint.end(), {pair / n, pair % n});
    return out;
}

}  // namespace

void bind_policies(nb::module_& m) {
    m.def("builtin_policies", &builtin_policy_names, "Names accepted by kv_policy besides a .kvp.bin path.");

    m.def(
        "policy_ranking",
        [](const std::string& name, const nb::dict& identity, int layer, const TokenHeadDim& k, const TokenHeadDim& v,
           const std::optional<TokenHeadDim>& q, const Positions& positions, uint32_t n_sink, uint32_t n_recent,
           uint64_t seed) {
            const ModelIdentity model = identity_from_dict(identity);
            if (layer < 0 || uint32_t(layer) >= model.n_layer)
                throw std::invalid_argument("layer " + std::to_string(layer) + " is not in a " +
                                            std::to_string(model.n_layer) + "-layer model");
            const size_t n = k.shape(0);
            if (n == 0) throw std::invalid_argument("no tokens to rank");
            check_shape(k, "k", n, model.n_head_kv, model.head_dim_k);
            check_shape(v, "v", n, model.n_head_kv, model.head_dim_v);
            if (q) {
                if (q->shape(0) == 0 || q->shape(0) > n) throw std::invalid_argument("q must hold 1..n queries");
                check_shape(*q, "q", q->shape(0), 0, model.head_dim_k);
            }
            if (positions.shape(0) != n) throw std::invalid_argument("positions must hold one entry per token");
            for (size_t i = 1; i < n; ++i)
                if (positions(i) <= positions(i - 1)) throw std::invalid_argument("positions must be increasing");

            std::optional<HeadTokenView> q_view;
            if (q) q_view = view_of(*q);
            Ranking r;
            {
                nb::gil_scoped_release release;
                r = rank_tokens(name, model, layer, view_of(k), view_of(v), q_view, positions.data(), n_sink, n_recent,
                                seed);
            }
            const size_t n_head = model.n_head_kv;
            nb::dict out;
            out["scores"] = to_numpy(std::move(r.scores), {n_head, n});
            out["ranking"] = to_numpy(std::move(r.ranking), {n_head, n});
            out["joint_ranking"] = to_numpy(std::move(r.joint), {n_head * n, size_t(2)});
            return out;
        },
        "name"_a, "identity"_a, "layer"_a, "k"_a, "v"_a, "q"_a.none(), "positions"_a, "n_sink"_a = 4,
        "n_recent"_a = 16, "seed"_a = 0,
        "The ranking view of one layer: the policy `name` (a built-in or a .kvp.bin path) scores n cached tokens from "
        "their post-RoPE keys k (n, n_head_kv, head_dim_k), values v (n, n_head_kv, head_dim_v), original positions "
        "(n,), increasing, also used as logical indices, and, for attention-based policies, the queries q (m, n_head, "
        "head_dim_k) of the last m of them. Returns scores (n_head_kv, n) as the policy writes them (higher = keep), "
        "ranking (n_head_kv, n): token indices per KV head from most to least valuable, and joint_ranking "
        "(n_head_kv * n, 2): (head, token) pairs over all heads. Protected tokens (position < n_sink, the last n_recent) "
        "rank first, a NaN or infinite score last; ties go to the more recent token, then to the lower head.");
}

}  // namespace kvp
