#include "speed.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>

#include "progress.h"

namespace kvp::bench {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

std::string format_number(double value, int decimals) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.*f", decimals, value);
    return buf;
}

int64_t physical_memory_bytes() {
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    return pages > 0 && page > 0 ? int64_t(pages) * int64_t(page) : 0;
}

// `count` tokens: the text repeated, or seeded draws among the vocabulary's ordinary tokens.
std::vector<llama_token> token_stream(const Model& model, const SpeedConfig& config, int64_t count) {
    std::vector<llama_token> tokens;
    tokens.reserve(size_t(count));
    if (!config.text.empty()) {
        while (int64_t(tokens.size()) < count) tokens.push_back(config.text[tokens.size() % config.text.size()]);
        return tokens;
    }
    std::mt19937_64 rng(config.seed);
    std::uniform_int_distribution<int32_t> pick(0, model.n_vocab() - 1);
    while (int64_t(tokens.size()) < count) {
        const llama_token t = pick(rng);
        if (!llama_vocab_is_control(model.vocab(), t) && !model.is_end_of_generation(t)) tokens.push_back(t);
    }
    return tokens;
}

struct Timing {
    double prefill_seconds = 0, decode_seconds = 0;
    int64_t cells_max = 0;
};

// Prefills `prompt`, then decodes `decode_tokens` greedily, one llama_decode per token.
Timing prefill_and_decode(Session& session, Engine* engine, const std::vector<llama_token>& prompt, int64_t decode_tokens) {
    SequenceWriter writer(session, engine ? std::vector<Engine*>{engine} : std::vector<Engine*>{}, 0);
    const int32_t n_vocab = session.model().n_vocab();
    llama_token next = 0;
    const LogitsSink pick = [&](size_t, const float* logits) { next = argmax(logits, n_vocab); };
    Timing timing;
    auto start = Clock::now();
    writer.feed(prompt, prompt.size() - 1, pick);
    timing.prefill_seconds = seconds_since(start);
    start = Clock::now();
    for (int64_t i = 0; i < decode_tokens; ++i) writer.feed(std::span<const llama_token>(&next, 1), 0, pick);
    timing.decode_seconds = seconds_since(start);
    timing.cells_max = writer.max_cells();
    return timing;
}

}  // namespace

int64_t current_rss_bytes() {
    std::ifstream statm("/proc/self/statm");
    int64_t size = 0, resident = 0;
    if (!(statm >> size >> resident)) return 0;
    return resident * int64_t(sysconf(_SC_PAGE_SIZE));
}

void to_json(json& j, const SpeedRow& row) {
    j = json{{"policy", row.policy},
             {"kv_mode", row.kv_mode},
             {"budget", row.budget == kUnbounded ? json(nullptr) : json(row.budget)},
             {"context", row.context},
             {"status", row.status},
             {"prefill_tokens_per_second", row.prefill_tokens_per_second},
             {"decode_ms_per_token", row.decode_ms_per_token},
             {"prefill_vs_full", row.prefill_vs_full},
             {"decode_vs_full", row.decode_vs_full},
             {"prefill_vs_shared", row.prefill_vs_shared},
             {"decode_vs_shared", row.decode_vs_shared},
             {"copy_ms_per_token", row.copy_ms_per_token},
             {"score_ms_per_token", row.score_ms_per_token},
             {"evict_ms_per_token", row.evict_ms_per_token},
             {"n_ctx", row.n_ctx},
             {"kv_bytes", row.kv_bytes},
             {"rss_bytes", row.rss_bytes},
             {"cells_max", row.cells_max},
             {"tokens_evicted", row.tokens_evicted}};
}

std::vector<std::string> speed_csv_columns() {
    const json row = SpeedRow{};  // a named object: items() refers to it
    std::vector<std::string> names;
    for (const auto& item : row.items()) names.push_back(item.key());
    return names;
}

std::vector<SpeedRow> run_speed(Model& model, const std::vector<PolicyFactory>& policies,
                                const std::vector<int64_t>& budgets, const SpeedConfig& config) {
    const int64_t memory_limit = int64_t(double(physical_memory_bytes()) * config.max_memory_fraction);
    const bool per_head_runs = includes_per_head(config.kv_modes);
    int64_t cases = 0;
    for (const PolicyFactory& policy : policies)
        for (const std::string& mode : policy.is_full() ? std::vector<std::string>{kSharedMode} : config.kv_modes)
            cases += runs_in_mode(policy, mode, config.kv_modes) ? (policy.is_full() ? 1 : int64_t(budgets.size())) : 0;
    Progress progress(cases * int64_t(config.contexts.size()));

    {  // warm-up: page in the weights and let the CPU settle before the first measured case
        ContextOptions options = config.context;
        options.n_ctx = 512;
        options.eval_callback = false;
        Session session(model, options);
        prefill_and_decode(session, nullptr, token_stream(model, config, 256), 8);
    }

    std::vector<SpeedRow> rows;
    for (int64_t context : config.contexts) {
        const std::vector<llama_token> prompt = token_stream(model, config, context);
        const SpeedRow* full = nullptr;
        size_t first_of_context = rows.size();
        // the full cache first: every policy's ratio is to it
        std::vector<const PolicyFactory*> order;
        for (const PolicyFactory& p : policies)
            if (p.is_full()) order.push_back(&p);
        for (const PolicyFactory& p : policies)
            if (!p.is_full()) order.push_back(&p);

        for (const PolicyFactory* policy : order) {
            const std::vector<int64_t> case_budgets = policy->is_full() ? std::vector<int64_t>{kUnbounded} : budgets;
            for (int64_t budget : case_budgets)
            for (const std::string& mode : policy->is_full() ? std::vector<std::string>{kSharedMode} : config.kv_modes) {
                if (!runs_in_mode(*policy, mode, config.kv_modes)) continue;
                SpeedRow row;
                row.policy = policy->label();
                row.kv_mode = mode;
                row.budget = budget;
                row.context = context;
                ContextOptions options = config.context;
                options.n_ctx = policy->is_full() ? context + config.decode_tokens + 1 : budget;
                row.kv_bytes = options.n_ctx * model.kv_bytes_per_cell();
                if (memory_limit > 0 && row.kv_bytes > memory_limit) {
                    row.status = "skipped: the KV cache needs " + std::to_string(row.kv_bytes >> 20) +
                                 " MiB, more than half the physical memory";
                    rows.push_back(row);
                    progress.done(display_label(row.policy) + " @ " + std::to_string(context) + " (skipped)");
                    continue;
                }
                std::unique_ptr<Engine> engine =
                    policy->is_full() ? nullptr : policy->make_engine(budget, mode == kPerHeadMode, per_head_runs);
                options.eval_callback = engine && engine->needs_callback();
                Session session(model, options);
                row.n_ctx = session.n_ctx();
                row.kv_bytes = row.n_ctx * model.kv_bytes_per_cell();
                if (engine) engine->attach(session.context());
                const Timing timing = prefill_and_decode(session, engine.get(), prompt, config.decode_tokens);
                row.prefill_tokens_per_second = double(context) / timing.prefill_seconds;
                row.decode_ms_per_token = 1000.0 * timing.decode_seconds / double(config.decode_tokens);
                row.cells_max = timing.cells_max;
                if (engine) {
                    const EngineStats stats = engine->stats();
                    const double per_token = 1000.0 / double(std::max<int64_t>(1, stats.tokens_seen));
                    row.copy_ms_per_token = stats.copy_seconds * per_token;
                    row.score_ms_per_token = stats.score_seconds * per_token;
                    row.evict_ms_per_token = stats.evict_seconds * per_token;
                    row.tokens_evicted = stats.tokens_evicted;
                }
                row.rss_bytes = current_rss_bytes();
                rows.push_back(row);
                const std::string at = budget == kUnbounded ? "" : "@" + std::to_string(budget);
                progress.done(display_label(row.policy) + at + (mode == kPerHeadMode ? " per-head" : "") + " @ " +
                              std::to_string(context) + " tokens");
            }
        }
        for (size_t i = first_of_context; i < rows.size(); ++i) {
            SpeedRow& row = rows[i];
            if (row.kv_mode != kPerHeadMode || row.status != "ok") continue;
            for (size_t j = first_of_context; j < rows.size(); ++j) {
                const SpeedRow& shared = rows[j];
                if (shared.kv_mode != kSharedMode || shared.policy != row.policy || shared.budget != row.budget ||
                    shared.status != "ok")
                    continue;
                row.prefill_vs_shared = row.prefill_tokens_per_second / shared.prefill_tokens_per_second;
                row.decode_vs_shared = shared.decode_ms_per_token / row.decode_ms_per_token;
            }
        }
        for (size_t i = first_of_context; i < rows.size(); ++i)
            if (rows[i].budget == kUnbounded && rows[i].status == "ok") full = &rows[i];
        if (!full) continue;
        for (size_t i = first_of_context; i < rows.size(); ++i) {
            if (rows[i].status != "ok") continue;
            rows[i].prefill_vs_full = rows[i].prefill_tokens_per_second / full->prefill_tokens_per_second;
            rows[i].decode_vs_full = full->decode_ms_per_token / rows[i].decode_ms_per_token;
        }
    }
    progress.finish();
    return rows;
}

void print_speed_table(std::ostream& out, const std::vector<SpeedRow>& rows) {
    const bool any_per_head =
        std::any_of(rows.begin(), rows.end(), [](const SpeedRow& r) { return r.kv_mode == kPerHeadMode; });
    std::vector<std::vector<std::string>> cells;
    for (const SpeedRow& r : rows) {
        const bool ok = r.status == "ok";
        const bool has_full = r.prefill_vs_full > 0;
        cells.push_back({display_label(r.policy), r.budget == kUnbounded ? "-" : std::to_string(r.budget),
                         std::to_string(r.context), ok ? format_number(r.prefill_tokens_per_second, 1) : r.status,
                         has_full ? format_number(r.prefill_vs_full, 3) : "-",
                         ok ? format_number(r.decode_ms_per_token, 2) : "-",
                         has_full ? format_number(r.decode_vs_full, 3) : "-",
                         ok ? format_number(r.copy_ms_per_token + r.score_ms_per_token, 4) : "-",
                         ok ? format_number(r.evict_ms_per_token, 4) : "-",
                         format_number(double(r.kv_bytes) / double(1 << 20), 1),
                         ok ? format_number(double(r.rss_bytes) / double(1 << 20), 0) : "-"});
        if (any_per_head) {
            const bool has_shared = r.prefill_vs_shared > 0;
            std::vector<std::string>& line = cells.back();
            line.insert(line.begin() + 1, r.kv_mode);
            line.insert(line.begin() + 8, has_shared ? format_number(r.decode_vs_shared, 3) : "-");
            line.insert(line.begin() + 6, has_shared ? format_number(r.prefill_vs_shared, 3) : "-");
        }
    }
    std::vector<std::string> header = {"policy", "budget", "context", "prefill t/s", "prefill vs full", "decode ms/t",
                                       "decode vs full", "capture+score ms/t", "evict ms/t", "KV MiB", "RSS MiB"};
    std::vector<bool> right(header.size(), true);
    right[0] = false;
    if (any_per_head) {
        header.insert(header.begin() + 1, "kv mode");
        header.insert(header.begin() + 8, "decode vs shared");
        header.insert(header.begin() + 6, "prefill vs shared");
        right.insert(right.begin() + 1, false);
        right.insert(right.end(), 2, true);  // the two ratio columns, numbers like the rest
    }
    print_markdown_table(out, header, right, cells);
}

}  // namespace kvp::bench
