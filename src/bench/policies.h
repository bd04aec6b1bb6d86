// The policies of a sweep, as named on the command line: `full` (the uncompressed reference, no engine), any
// built-in name of kvp::builtin_policy_names(), `kvp:PATH` or a bare path to a .kvp.bin file.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvp/engine.h"

struct llama_model;

namespace kvp::bench {

struct EngineOptions {
    uint64_t seed = 0;         // of `random`
    int n_threads = 0;         // scorer threads
    int64_t n_sink = -1;       // -1: the policy's default
    int64_t n_recent = -1;
    HeadCombine combine = HeadCombine::sum_softmax;
    double evict_fraction = 0.0625;
    std::optional<double> head_consensus;  // per-head engines' share of all heads' vote; unset: kDefaultHeadConsensus
    ScoringPath scoring = ScoringPath::automatic;  // where learned policies' MLPs run
    EvictionUnit eviction_unit = EvictionUnit::word;  // the library's default too
    double stretch = 0.0;  // EngineConfig::stretch
};

class PolicyFactory {
public:
    // Checks the name (or loads and checks the policy file) right away, so a bad name fails before any work.
    PolicyFactory(const std::string& label, const llama_model* model, const EngineOptions& options);

    const std::string& label() const { return label_; }  // as given: "full", "streaming", "kvp:models/x.kvp.bin"
    // FNV-1a of a learned policy's file bytes (16 hex digits), empty for the others: results in a log carry it, so
    // that a resumed sweep notices when the file behind a label changed.
    const std::string& file_digest() const { return file_digest_; }
    bool is_full() const { return source_.empty(); }
    EvictionUnit eviction_unit() const { return options_.eviction_unit; }
    double per_head_consensus() const { return resolve_head_consensus(options_.head_consensus, true); }
    const std::string& policy_name() const { return policy_name_; }  // the policy's own name(); "full" for full
    bool attention_based() const { return attention_based_; }        // scores from observed queries
    bool captures_kv() const { return captures_kv_; }
    // Per-head mode ranks each (layer, KV head) by its own score column. A policy with one score per token evicts
    // the same tokens in every head (per-head mode changes nothing for it); one scoring per layer (tova) cannot
    // run per head.
    bool scores_per_head() const { return scores_per_head_; }
    bool scores_per_token() const { return scores_per_token_; }
    Protection protection() const { return protection_; }
    int64_t min_budget() const { return int64_t(protection_.n_sink) + protection_.n_recent + 1; }

    // A fresh engine for this policy (not for `full`), not yet attached. per_head: each (layer, KV head) evicts its
    // own tokens (needs the patched llama.cpp); original_positions: no position compaction (per-head mode needs it,
    // and llama.cpp cannot shift positions in a context where per-head mode is on).
    std::unique_ptr<Engine> make_engine(int64_t budget, bool per_head = false, bool original_positions = false) const;

private:
    std::unique_ptr<EvictionPolicy> make_policy() const;

    std::string label_, source_, policy_name_, file_digest_;
    const llama_model* model_;
    ModelIdentity identity_;
    EngineOptions options_;
    std::shared_ptr<const Policy> file_;  // for learned policies: loaded once, shared by every engine
    Protection protection_;
    bool attention_based_ = false, captures_kv_ = false, scores_per_head_ = false, scores_per_token_ = false;
};

// Whether `policy` runs in kv mode `mode` of a run over `modes`: shared always; per-head for policies that score
// per (layer, KV head), and for one-score-per-token policies only when shared mode is not in the run (per head,
// they evict exactly what they evict shared).
bool runs_in_mode(const PolicyFactory& policy, const std::string& mode, const std::vector<std::string>& modes);

// Comma-separated labels; empty items are skipped.
std::vector<std::string> split_list(const std::string& text);

}  // namespace kvp::bench
