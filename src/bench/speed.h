// --speed: what a policy costs in time and memory against llama.cpp's full cache, measured side by side in one run.
//
// For each logical context length L (--contexts), the full cache runs first: a context of L + D cells with no
// engine and no eval callback, L tokens prefilled in n_batch chunks, then D tokens decoded greedily one at a time.
// Then each (policy, budget) runs the same tokens in the bounded protocol, as kvp_cpp.Llama does: a context of
// `budget` cells, the engine evicting before each batch, the eval callback installed only if the policy captures
// tensors. Rows report throughput, the ratio to the full cache at the same L, the engine's time per token in
// capture, scoring and eviction, the KV bytes llama.cpp allocated and the process RSS.
// With kv_modes shared and per_head, each (policy, budget) runs in both modes, the per-head run right after the
// shared one, and per-head rows also report their throughput ratio to that shared run. Engines then keep original
// positions in both modes (per-head mode needs them), so the two differ only in how heads evict.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "policies.h"
#include "results.h"
#include "session.h"

namespace kvp::bench {

struct SpeedConfig {
    std::vector<int64_t> contexts;  // logical tokens prefilled before decoding
    int64_t decode_tokens = 64;
    ContextOptions context;         // n_ctx is set per case
    std::vector<llama_token> text;  // token source, repeated to fill a context; empty: seeded ordinary tokens
    uint64_t seed = 0;
    double max_memory_fraction = 0.5;  // cases whose KV cache would exceed this share of physical memory are skipped
    std::vector<std::string> kv_modes = {kSharedMode};
};

struct SpeedRow {
    std::string policy;
    std::string kv_mode = kSharedMode;
    int64_t budget = kUnbounded;
    int64_t context = 0;
    std::string status = "ok";  // or "skipped: ..."
    double prefill_tokens_per_second = 0, decode_ms_per_token = 0;
    double prefill_vs_full = 0, decode_vs_full = 0;  // throughput ratios to the full cache at the same context
    double prefill_vs_shared = 0, decode_vs_shared = 0;  // per-head rows: ratios to the shared run of the same case
    double copy_ms_per_token = 0, score_ms_per_token = 0, evict_ms_per_token = 0;  // engine time over all tokens
    int64_t n_ctx = 0, kv_bytes = 0, rss_bytes = 0, cells_max = 0, tokens_evicted = 0;
};

void to_json(json& j, const SpeedRow& row);
std::vector<std::string> speed_csv_columns();

std::vector<SpeedRow> run_speed(Model& model, const std::vector<PolicyFactory>& policies,
                                const std::vector<int64_t>& budgets, const SpeedConfig& config);

void print_speed_table(std::ostream& out, const std::vector<SpeedRow>& rows);

int64_t current_rss_bytes();

}  // namespace kvp::bench
