// Eviction policies: one small interface, one source file per policy, one registry.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvp/format.h"
#include "kvp/ledger.h"
#include "kvp/scorer.h"

namespace kvp {

// A policy turns what the hook captured into keep-scores (higher = keep), written once per token into the
// ledger's score row. A row has n_score_columns() entries: one per (scored layer, KV head) for per-head
// policies, one for token-level heuristics. The evictor combines the columns into one keep-score per token.
class EvictionPolicy {
public:
    virtual ~EvictionPolicy() = default;
    virtual std::string name() const = 0;
    virtual int n_score_columns() const = 0;

    // Per-head policies whose columns cover some layers only (a kvp.bin scoring Gemma 3's global layers): the model
    // layer of each group of n_head_kv columns, in column order. Empty: see per_head_score_layers().
    virtual std::vector<int> score_layers() const { return {}; }

    // Protected counts a policy was trained with (kvp.bin records them); heuristics use the defaults.
    virtual uint32_t default_sink() const { return 4; }
    virtual uint32_t default_recent() const { return 16; }

    // Layers whose post-RoPE K and V the hook must capture; empty means no eval callback is installed at all.
    virtual std::vector<int> capture_layers() const { return {}; }

    // Scores that need nothing but the token's logical index and original position, called once per new token
    // batch before it is decoded. rows[i * row_stride + c] for column c.
    virtual void score_positions(const int64_t* logical, const int64_t* original_pos, int n, float* rows,
                                 size_t row_stride) {
        (void)logical, (void)original_pos, (void)n, (void)rows, (void)row_stride;
    }

    // Scores from one layer's K and V for the n = k.n_token tokens of a ubatch, called by the hook.
    // `logical` gives each token's logical index (to key any per-token state a policy keeps).
    virtual void score_kv(int layer, const HeadTokenView& k, const HeadTokenView& v, const int64_t* original_pos,
                          const int64_t* logical, float* rows, size_t row_stride) {
        (void)layer, (void)k, (void)v, (void)original_pos, (void)logical, (void)rows, (void)row_stride;
    }

    // The MLP that score_kv runs, for llama.cpp to run inside the decode graph instead (the patched library's
    // in-graph scoring); null for policies that score otherwise. A policy that returns one takes the scores the
    // graph computed for a layer, [n][n_head_kv], through store_graph_scores, in place of score_kv.
    virtual const Policy* graph_scorer() const { return nullptr; }
    virtual void store_graph_scores(int layer, const float* scores, int64_t n, float* rows, size_t row_stride) {
        (void)layer, (void)scores, (void)n, (void)rows, (void)row_stride;
    }

    // Layers whose post-RoPE queries (Qcur-<layer>) the hook must capture, for attention-based policies.
    virtual std::vector<int> query_layers() const { return {}; }
    // The queries of one layer for the tokens of a ubatch (q.n_head = the model's query heads).
    virtual void observe_queries(int layer, const HeadTokenView& q, const int64_t* original_pos,
                                 const int64_t* logical) {
        (void)layer, (void)q, (void)original_pos, (void)logical;
    }

    // Called right before the evictor ranks the cached tokens. Policies whose scores depend on the whole cache
    // (KeyDiff's mean key, LagKV's partitions, attention received from recent queries) rewrite the score rows of
    // every ledger entry here; policies that score each token once leave them alone.
    virtual void refresh_scores(Ledger& ledger) { (void)ledger; }

    // Terms that depend on how long ago a token was written (a kvp.bin's learned recency terms), which no score
    // written once can hold. The evictor ranks a copy of the ledger to which add_recency_terms added them, for a
    // cache whose next token takes original position `next_position`; the ledger keeps the scores as written.
    virtual bool has_recency_terms() const { return false; }
    virtual void add_recency_terms(Ledger& ranking, int64_t next_position) const {
        (void)ranking, (void)next_position;
    }

    // Tokens that left the cache (evicted, truncated, reset), ascending logical indices: drop any per-token state.
    // After load_state the ledger may hold tokens a policy never saw (its state is not saved); refresh_scores
    // must then keep their existing score rows.
    virtual void forget(const std::vector<int64_t>& logical) { (void)logical; }
    // Host memory a policy holds beyond the ledger (e.g. copies of cached keys), reported by kv_stats().
    virtual size_t state_bytes() const { return 0; }
};

struct PolicyOptions {
    uint64_t seed = 0;       // for `random`
    std::string kernel = "auto";
    int n_threads = 0;
};

// The model layer of each group of n_head_kv score columns of a per-head policy: score_layers(), or every layer
// in order for a policy with n_layer x n_head_kv columns. Empty for a policy without one column per (layer, KV head)
// (token-level heuristics, TOVA's per-layer columns on a model with several KV heads).
std::vector<int> per_head_score_layers(const EvictionPolicy& policy, const ModelIdentity& model);

// Names of the built-in policies (a path to a .kvp.bin file is accepted by make_policy too).
std::vector<std::string> builtin_policy_names();

// A built-in name, or a path to a kvp.bin file checked against `model`. Throws std::invalid_argument for an
// unknown name and FormatError for a bad or mismatched file.
std::unique_ptr<EvictionPolicy> make_policy(const std::string& name_or_path, const ModelIdentity& model,
                                            const PolicyOptions& options);

// The learned policy, from an already loaded file.
std::unique_ptr<EvictionPolicy> make_learned_policy(std::shared_ptr<const Policy> file, const PolicyOptions& options);

}  // namespace kvp
