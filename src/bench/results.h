// Per-sample records, the resumable results log, and the aggregated table / JSON / CSV.
#pragma once

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <iosfwd>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace kvp::bench {

using json = nlohmann::ordered_json;  // keeps the field order of records and rows

// JSON text (indent < 0: one line). A prediction can end inside a multi-byte character: its stray bytes become U+FFFD.
inline std::string json_text(const json& value, int indent = -1) {
    return value.dump(indent, ' ', false, json::error_handler_t::replace);
}

constexpr int64_t kUnbounded = 0;  // the budget of the `full` reference (null in JSON, empty in CSV)
constexpr const char* kSchema = "kvp-bench/1";
constexpr const char* kSharedMode = "shared";    // one token set for every head (stock llama.cpp)
constexpr const char* kPerHeadMode = "per_head"; // each (layer, KV head) evicts its own (the patched llama.cpp)

// Whether a run's --kv-modes include per-head mode.
inline bool includes_per_head(const std::vector<std::string>& kv_modes) {
    return std::find(kv_modes.begin(), kv_modes.end(), kPerHeadMode) != kv_modes.end();
}

// What a per-sample record is keyed by, besides the sample itself: a rerun with the same -o skips the records
// whose key it finds. Other settings (threads, sink/recent, ...) are not part of the key: use another -o.
struct RecordKey {
    std::string model, protocol, variant, task;
    int64_t length = 0, index = 0;
    std::string policy;
    int64_t budget = kUnbounded;
    std::string kv_mode = kSharedMode;  // absent from logs written before per-head mode: shared
    // Per-head records only (written and keyed for them): absent from logs written before it was recorded, when
    // the default was 0.
    double head_consensus = 0.0;
    // "word" for engines that evict whole words (--evict-unit); absent from records of token-level eviction
    std::string evict_unit = "token";

    std::string str() const;
    static RecordKey of(const json& record);
    void write_to(json& record) const;
};

// The per-sample log: one JSON object per line, appended and flushed as each result is done. A truncated last line
// (an interrupted run) is ignored.
class ResultLog {
public:
    explicit ResultLog(const std::string& path);
    bool has(const RecordKey& key) const { return keys_.count(key.str()) != 0; }
    void append(const json& record);
    const std::vector<json>& records() const { return records_; }
    const std::string& path() const { return path_; }
    int64_t skipped_lines() const { return skipped_lines_; }

private:
    std::string path_;
    std::ofstream out_;
    std::vector<json> records_;
    std::set<std::string> keys_;
    int64_t skipped_lines_ = 0;
};

// One (policy, budget, task, length) cell of the sweep, aggregated over samples.
struct ResultRow {
    std::string policy;
    std::string kv_mode = kSharedMode;
    std::string evict_unit = "token";  // in every row (the per-sample records carry it only when "word")
    int64_t budget = kUnbounded;
    std::string task;
    int64_t length = 0;
    std::string protocol, variant, metric;
    double score = 0;   // RULER metrics: mean per-sample score in percent, rounded to 2 decimals; mean_nll: nats/token
    double stderr_ = 0; // standard error of that mean over samples
    int64_t n = 0;
    int64_t cells_max = 0;        // most cells the engine (or the full cache) held during any sample
    int64_t llama_cells_max = 0;  // most cells llama.cpp reported holding at the end of any sample
    double prompt_tokens = 0, decoded_tokens = 0, generated_tokens = 0, seconds = 0;  // means per sample
};

void to_json(json& j, const ResultRow& row);

// Rows for the given records, ordered by variant, policy, kv mode (shared first), budget, task (each name as in its
// order), length.
std::vector<ResultRow> aggregate(const std::vector<const json*>& records, const std::vector<std::string>& variant_order,
                                 const std::vector<std::string>& policy_order, const std::vector<std::string>& task_order);

// A llama-bench-style markdown table: variant, policy, budget, task, length, score ± stderr, n; with a `mean` row
// per (variant, policy, budget, length) over the tasks when there are several. A `kv mode` column follows the
// policy when any row is per-head.
void print_table(std::ostream& out, const std::vector<ResultRow>& rows);

void write_csv(const std::string& path, const std::vector<ResultRow>& rows);
// Rows of JSON objects as CSV with the given columns: null as empty, floats in shortest round-trip form.
void write_csv_rows(const std::string& path, const std::vector<std::string>& columns, const std::vector<json>& rows);
// A markdown table (llama-bench style), columns padded to their widest cell, right-aligned where asked.
void print_markdown_table(std::ostream& out, const std::vector<std::string>& header, const std::vector<bool>& right,
                          const std::vector<std::vector<std::string>>& rows);
std::vector<std::string> csv_columns();

double round_to_cents(double value);  // Python's round(value, 2)
// A policy label as tables show it: kvp:models/x.kvp.bin -> kvp:x (kvp_cpp.plot.short_label); others unchanged.
std::string display_label(const std::string& label);

}  // namespace kvp::bench
