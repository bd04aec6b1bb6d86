// kvp-bench: KV-cache eviction policies against the full cache on RULER tasks (or perplexity), in llama.cpp.
// Usage: kvp-bench --help. The kvp-bench console script (python/kvp_cpp/bench.py) runs this binary with the
// default model and a default task file when none are given.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "llama.h"
#include "metrics.h"
#include "modes.h"
#include "progress.h"
#include "results.h"
#include "session.h"
#include "speed.h"
#include "sweep.h"

namespace kvp::bench {
namespace {

constexpr const char* kUsage = R"(usage: kvp-bench -m MODEL.gguf (--tasks FILE.jsonl | --text FILE.txt | --speed) [options]

Benchmarks KV-cache eviction policies against the full cache, in llama.cpp.

modes
  --tasks FILE.jsonl        task accuracy on RULER samples (python -m kvp_cpp.ruler): greedy generation after the
                            answer prefix, scored with the sample's metric (string_match_all / string_match_part)
  --text FILE.txt           perplexity: windows of --ctx context tokens, then the mean NLL of --cont tokens
                            (FILE.jsonl: documents {"text": ...}, one per line, each cut into its own windows)
  --ctx N, --cont M         perplexity window (default 1024, 128)
  --score-predictions FILE  score JSONL lines {"prediction", "outputs", "metric"} with the RULER metrics and exit
  --speed                   time and memory: prefill and decode throughput of each policy and budget (bounded
                            protocol) against the full cache at each of --contexts, side by side in one run
  --contexts LIST           --speed: logical context lengths (default 2048,8192)
  --decode-tokens N         --speed: tokens decoded after each prefill (default 64)
                            (tokens: --text FILE repeated, else seeded ordinary tokens of the vocabulary)

sweep
  -m, --model PATH          GGUF model
  --policies LIST           comma-separated: full (the uncompressed reference), a built-in policy (%s),
                            kvp:PATH or a path to a .kvp.bin file (default full,streaming,random)
  --budgets LIST            cache sizes in tokens (default 128,256,512,1024)
  --protocol NAME           oneshot: prefill once per sample, then compress to each budget (default);
                            bounded: the cache is held to the budget from the first token (a prefill per budget)
  --variants LIST           oneshot task variants: question_included (the paper's RULER protocol: the question is
                            compressed with the context), question_excluded (kvpress's default: the question is
                            appended after compression) (default: both)
  --samples N               at most N samples per task and length, or N text windows (default all)
  --max-new-tokens N        generate at most N tokens (default: each sample's max_new_tokens)

engine
  --sink N, --recent N      protected first / last tokens (default: the policy's, else 4 and 16)
  --combine NAME            per-head score combination: sum_softmax (default), max_softmax, mean, mean_rank
  --stretch X               shared mode: the budget the ranking's confident picks (keep-score >= X x the mean) leave
                            is an unbroken stretch of the oldest unprotected tokens (default 0: off)
  --evict-fraction F        a full cache sheds at least F x budget at once while decoding (default 0.0625)
  --kv-modes LIST           shared (one token set for all heads, default), per_head (each layer and KV head keeps
                            and evicts its own tokens; the patched llama.cpp of python -m kvp_cpp.llama_build, which
                            the launcher loads), or both: every policy runs in each, side by side. With per_head,
                            every engine keeps original positions (docs/per_head.md)
  --head-consensus W        per_head: each head ranks by (1 - W) x its own softmax + W x all heads' mean softmax,
                            in [0, 1] (default 0.9, docs/per_head.md; 0: every head by its own scores, the paper's
                            per-head eviction; 1: shared mode's ranking). Per-head results are keyed by it
  --evict-unit word|token   word (default, as the library's): the sub-word tokens of a word are ranked by the
                            word's best score and stay or leave together; token: every token by its own score (the
                            paper's protocol). Records are keyed by it (evict_unit; absent means token)
  --scoring PATH             where learned policies' MLPs run: auto (default: in llama.cpp's decode graph with the
                            patched llama.cpp and a GPU, else on the CPU through the eval callback), callback, graph
  --seed N                  seed of the random policy (default 0)

llama.cpp
  -t, --threads N           threads of llama.cpp and of the policy scorer (default: the CPU count)
  -b, --batch-size N        tokens per llama_decode (default 512)
  --flash-attn on|off|auto  (default auto)
  -v, --verbose             show llama.cpp's log

output
  -o, --output FILE.json    results (default kvp-bench.json); FILE.csv and the per-sample log FILE.samples.jsonl
                            are written next to it. A rerun with the same -o skips the samples in the log.
  -h, --help
)";

struct UsageError : std::invalid_argument {
    using std::invalid_argument::invalid_argument;
};

struct Options {
    std::string model_path, tasks_path, text_path, score_path;
    std::string output_path = "kvp-bench.json";
    std::vector<std::string> policies = {"full", "streaming", "random"};
    std::vector<int64_t> budgets = {128, 256, 512, 1024};
    Protocol protocol = Protocol::oneshot;
    std::vector<std::string> variants;  // empty on the command line: the mode's default
    bool variants_given = false;
    int64_t ctx_tokens = 1024, cont_tokens = 128, samples = 0, max_new_tokens = 0;
    EngineOptions engine;
    int n_threads = int(std::max(1u, std::thread::hardware_concurrency())), n_batch = 512;
    std::string flash_attn = "auto";
    bool verbose = false;
    bool speed = false;
    std::vector<int64_t> contexts = {2048, 8192};
    std::vector<std::string> kv_modes = {kSharedMode};
    int64_t decode_tokens = 64;
};

int64_t parse_int(const std::string& flag, const std::string& text, int64_t min) {
    size_t used = 0;
    int64_t value = 0;
    try {
        value = std::stoll(text, &used);
    } catch (const std::exception&) {
        used = 0;
    }
    if (used != text.size() || text.empty() || value < min)
        throw UsageError(flag + " needs an integer >= " + std::to_string(min) + ", got '" + text + "'");
    return value;
}

// NaN when the whole text is not a number.
double parse_number(const std::string& text) {
    size_t used = 0;
    double value = NAN;
    try {
        value = std::stod(text, &used);
    } catch (const std::exception&) {
        used = 0;
    }
    return used == text.size() && !text.empty() ? value : NAN;
}

double parse_fraction(const std::string& flag, const std::string& text) {
    const double value = parse_number(text);
    if (!(value >= 0.0 && value <= 1.0)) throw UsageError(flag + " needs a number in [0, 1], got '" + text + "'");
    return value;
}

double parse_nonnegative(const std::string& flag, const std::string& text) {
    const double value = parse_number(text);
    if (!(value >= 0.0) || !std::isfinite(value))
        throw UsageError(flag + " needs a finite number >= 0, got '" + text + "'");
    return value;
}

Options parse_args(int argc, char** argv) {
    Options o;
    std::vector<std::string> args(argv + 1, argv + argc);
    for (size_t i = 0; i < args.size(); ++i) {
        const std::string& flag = args[i];
        auto value = [&]() -> const std::string& {
            if (i + 1 >= args.size()) throw UsageError(flag + " needs a value");
            return args[++i];
        };
        if (flag == "-h" || flag == "--help") {
            std::string builtins;
            for (const std::string& name : builtin_policy_names()) builtins += (builtins.empty() ? "" : ", ") + name;
            std::printf(kUsage, builtins.c_str());
            std::exit(0);
        } else if (flag == "-m" || flag == "--model") o.model_path = value();
        else if (flag == "--tasks") o.tasks_path = value();
        else if (flag == "--text") o.text_path = value();
        else if (flag == "--score-predictions") o.score_path = value();
        else if (flag == "--ctx") o.ctx_tokens = parse_int(flag, value(), 2);
        else if (flag == "--cont") o.cont_tokens = parse_int(flag, value(), 1);
        else if (flag == "--policies") o.policies = split_list(value());
        else if (flag == "--budgets") {
            o.budgets.clear();
            for (const std::string& item : split_list(value())) o.budgets.push_back(parse_int(flag, item, 1));
            std::sort(o.budgets.begin(), o.budgets.end());
            o.budgets.erase(std::unique(o.budgets.begin(), o.budgets.end()), o.budgets.end());
        } else if (flag == "--protocol") o.protocol = protocol_from_name(value());
        else if (flag == "--variants") {
            o.variants = split_list(value());
            o.variants_given = true;
        }
        else if (flag == "--samples") o.samples = parse_int(flag, value(), 1);
        else if (flag == "--max-new-tokens") o.max_new_tokens = parse_int(flag, value(), 1);
        else if (flag == "--sink") o.engine.n_sink = parse_int(flag, value(), 0);
        else if (flag == "--recent") o.engine.n_recent = parse_int(flag, value(), 1);
        else if (flag == "--combine") o.engine.combine = head_combine_from_name(value());
        else if (flag == "--stretch") o.engine.stretch = parse_nonnegative(flag, value());
        else if (flag == "--evict-fraction") o.engine.evict_fraction = parse_fraction(flag, value());
        else if (flag == "--head-consensus") o.engine.head_consensus = parse_fraction(flag, value());
        else if (flag == "--scoring") o.engine.scoring = scoring_path_from_name(value());
        else if (flag == "--evict-unit") o.engine.eviction_unit = eviction_unit_from_name(value());
        else if (flag == "--kv-modes") {
            o.kv_modes = split_list(value());
            if (o.kv_modes.empty()) throw UsageError("--kv-modes is empty");
            for (const std::string& mode : o.kv_modes)
                if (mode != kSharedMode && mode != kPerHeadMode)
                    throw UsageError("--kv-modes takes shared and per_head, not '" + mode + "'");
            if (std::set<std::string>(o.kv_modes.begin(), o.kv_modes.end()).size() != o.kv_modes.size())
                throw UsageError("--kv-modes lists a mode twice");
        }
        else if (flag == "--seed") o.engine.seed = uint64_t(parse_int(flag, value(), 0));
        else if (flag == "-t" || flag == "--threads") o.n_threads = int(parse_int(flag, value(), 1));
        else if (flag == "-b" || flag == "--batch-size") o.n_batch = int(parse_int(flag, value(), 1));
        else if (flag == "--flash-attn") o.flash_attn = value();
        else if (flag == "-o" || flag == "--output") o.output_path = value();
        else if (flag == "-v" || flag == "--verbose") o.verbose = true;
        else if (flag == "--speed") o.speed = true;
        else if (flag == "--decode-tokens") o.decode_tokens = parse_int(flag, value(), 1);
        else if (flag == "--contexts") {
            o.contexts.clear();
            for (const std::string& item : split_list(value())) o.contexts.push_back(parse_int(flag, item, 2));
            if (o.contexts.empty()) throw UsageError("--contexts is empty");
        }
        else throw UsageError("unknown argument '" + flag + "'");
    }
    o.engine.n_threads = o.n_threads;
    if (!o.score_path.empty()) return o;
    if (o.model_path.empty()) throw UsageError("-m MODEL.gguf is required");
    if (o.speed && !o.tasks_path.empty())
        throw UsageError("--speed takes its tokens from --text or makes them; not --tasks");
    if (!o.speed && o.tasks_path.empty() == o.text_path.empty())
        throw UsageError("give exactly one of --tasks and --text");
    if (o.policies.empty()) throw UsageError("--policies is empty");
    if (std::set<std::string>(o.policies.begin(), o.policies.end()).size() != o.policies.size())
        throw UsageError("--policies lists a policy twice");
    if (o.budgets.empty()) throw UsageError("--budgets is empty");
    if (o.variants.empty()) {
        if (o.text_path.empty()) o.variants = {kQuestionIncluded};
        if (o.text_path.empty() && o.protocol == Protocol::oneshot) o.variants.push_back(kQuestionExcluded);
        if (!o.text_path.empty()) o.variants = {kContinuation};
    } else {
        if (!o.text_path.empty()) throw UsageError("--variants applies to --tasks; perplexity has one variant");
        for (const std::string& v : o.variants)
            if (v != kQuestionIncluded && v != kQuestionExcluded)
                throw UsageError("--variants takes question_included and question_excluded, not '" + v + "'");
        if (std::set<std::string>(o.variants.begin(), o.variants.end()).size() != o.variants.size())
            throw UsageError("--variants lists a variant twice");
        if (o.protocol == Protocol::bounded && o.variants != std::vector<std::string>{kQuestionIncluded})
            throw UsageError("the bounded protocol holds the whole prompt under the budget: only question_included");
    }
    return o;
}

// --- --score-predictions ----------------------------------------------------------------------------------------

int score_predictions(const std::string& path) {
    std::ifstream in(path);
    if (!in) throw std::invalid_argument("cannot read " + path);
    json scores = json::array();
    std::map<std::string, std::vector<double>> by_metric;
    for (std::string line; std::getline(in, line);) {
        if (line.empty()) continue;
        const json item = json::parse(line);
        const std::string metric = item.at("metric").get<std::string>();
        const double score = sample_score(metric, item.at("prediction").get<std::string>(),
                                          item.at("outputs").get<std::vector<std::string>>());
        scores.push_back(score);
        by_metric[metric].push_back(score);
    }
    json aggregate = json::object();
    for (const auto& [metric, values] : by_metric) {
        double sum = 0;
        for (double v : values) sum += v;
        aggregate[metric] = round_to_cents(sum / double(values.size()));
    }
    std::cout << json{{"scores", scores}, {"aggregate", aggregate}}.dump() << std::endl;
    return 0;
}

// --- the sweep --------------------------------------------------------------------------------------------------

std::string with_extension(const std::string& json_path, const std::string& extension) {
    std::filesystem::path p(json_path);
    if (p.extension() == ".json") p.replace_extension();
    return p.string() + extension;
}

int64_t peak_rss_bytes() {
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    return int64_t(usage.ru_maxrss) * 1024;
}

void quiet_log(ggml_log_level level, const char* text, void*) {
    if (level == GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

json identity_json(const ModelIdentity& id) {
    return {{"arch", id.arch},           {"n_layer", id.n_layer},         {"n_head_kv", id.n_head_kv},
            {"head_dim_k", id.head_dim_k}, {"head_dim_v", id.head_dim_v}, {"n_ctx_train", id.n_ctx_train}};
}

json policies_json(const std::vector<PolicyFactory>& policies) {
    json out = json::array();
    for (const PolicyFactory& p : policies) {
        json entry = {{"label", p.label()}, {"name", p.policy_name()}, {"attention_based", p.attention_based()},
                      {"captures_kv", p.captures_kv()}};
        if (!p.is_full()) {
            entry["n_sink"] = p.protection().n_sink;
            entry["n_recent"] = p.protection().n_recent;
        }
        out.push_back(entry);
    }
    return out;
}

// The per-head engines' consensus, as the run used it; null when no engine runs per head.
json head_consensus_json(const Options& o) {
    return includes_per_head(o.kv_modes) ? json(resolve_head_consensus(o.engine.head_consensus, true)) : json(nullptr);
}

// Before any work: each budget against each policy, and the patched llama.cpp for per-head mode.
void check_policies(const std::vector<PolicyFactory>& policies, const Options& o) {
    const bool per_head = includes_per_head(o.kv_modes);
    if (o.engine.head_consensus.value_or(0.0) != 0.0 && !per_head)
        throw std::invalid_argument("--head-consensus applies to per-head eviction: add --kv-modes per_head");
    if (o.engine.stretch != 0.0 && per_head)
        throw std::invalid_argument("--stretch applies to shared mode only: drop per_head from --kv-modes");
    if (o.engine.stretch != 0.0 && o.engine.combine != HeadCombine::sum_softmax &&
        o.engine.combine != HeadCombine::max_softmax)
        throw std::invalid_argument("--stretch needs --combine sum_softmax or max_softmax");
    for (const PolicyFactory& policy : policies) {
        if (policy.is_full()) continue;
        const bool runs = std::any_of(o.kv_modes.begin(), o.kv_modes.end(), [&](const std::string& mode) {
            return runs_in_mode(policy, mode, o.kv_modes);
        });
        if (!runs)
            throw std::invalid_argument(display_label(policy.label()) + " scores per layer, not per KV head: it cannot "
                                        "evict per head (run it with --kv-modes shared)");
        if (per_head && !runs_in_mode(policy, kPerHeadMode, o.kv_modes))
            std::fprintf(stderr, "[kvp-bench] %s runs shared only: %s\n", display_label(policy.label()).c_str(),
                         policy.scores_per_token() ? "one score per token evicts the same tokens in every head"
                                                   : "it scores per layer, not per KV head");
        for (int64_t budget : o.budgets) policy.make_engine(budget, per_head);
    }
    if (per_head && !per_head_available())
        throw std::invalid_argument("--kv-modes per_head needs the patched llama.cpp, and this process loaded the stock "
                                    "one: build it once with python -m kvp_cpp.llama_build, then run kvp-bench through "
                                    "its launcher (which loads it)");
}

json run_json(double wall_seconds) {
    return {{"wall_seconds", wall_seconds}, {"peak_rss_bytes", peak_rss_bytes()}};
}

int run_speed_benchmark(const Options& o) {
    const auto start = std::chrono::steady_clock::now();
    if (!o.verbose) llama_log_set(quiet_log, nullptr);
    llama_backend_init();
    Model model(o.model_path);
    std::vector<PolicyFactory> policies;
    for (const std::string& label : o.policies) policies.emplace_back(label, model.get(), o.engine);
    check_policies(policies, o);

    SpeedConfig config;
    config.kv_modes = o.kv_modes;
    config.contexts = o.contexts;
    config.decode_tokens = o.decode_tokens;
    config.context.n_batch = o.n_batch;
    config.context.n_threads = o.n_threads;
    config.context.flash_attn = o.flash_attn;
    config.seed = o.engine.seed;
    if (!o.text_path.empty()) {
        std::ifstream in(o.text_path, std::ios::binary);
        if (!in) throw std::invalid_argument("cannot read the text file " + o.text_path);
        std::stringstream text;
        text << in.rdbuf();
        config.text = model.tokenize(text.str());
        if (config.text.empty()) throw std::invalid_argument(o.text_path + " has no tokens");
    }
    const std::vector<SpeedRow> rows = run_speed(model, policies, o.budgets, config);

    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const std::string csv_path = with_extension(o.output_path, ".csv");
    const json document = {
        {"schema", kSchema},
        {"mode", "speed"},
        {"model", {{"path", o.model_path}, {"name", std::filesystem::path(o.model_path).filename().string()},
                   {"identity", identity_json(model_identity(model.get()))},
                   {"kv_bytes_per_cell", model.kv_bytes_per_cell()}}},
        {"config", {{"policies", policies_json(policies)}, {"budgets", o.budgets}, {"contexts", o.contexts},
                    {"decode_tokens", o.decode_tokens}, {"tokens", o.text_path.empty() ? "random" : o.text_path},
                    {"threads", o.n_threads}, {"batch_size", o.n_batch}, {"flash_attn", o.flash_attn},
                    {"combine", head_combine_name(o.engine.combine)}, {"stretch", o.engine.stretch},
                    {"evict_fraction", o.engine.evict_fraction},
                    {"kv_modes", o.kv_modes}, {"head_consensus", head_consensus_json(o)},
                    {"scoring", scoring_path_name(o.engine.scoring)},
                    {"evict_unit", eviction_unit_name(o.engine.eviction_unit)}}},
        {"run", run_json(wall)},
        {"files", {{"csv", csv_path}}},
        {"speed", rows}};
    std::ofstream out(o.output_path);
    out << json_text(document, 2) << '\n';
    if (!out) throw std::runtime_error("cannot write " + o.output_path);
    std::vector<json> objects(rows.begin(), rows.end());
    write_csv_rows(csv_path, speed_csv_columns(), objects);
    print_speed_table(std::cout, rows);
    std::fprintf(stderr, "[kvp-bench] %zu speed cases in %s; wrote %s, %s\n", rows.size(),
                 format_duration(wall).c_str(), o.output_path.c_str(), csv_path.c_str());
    return 0;
}

int run_benchmark(const Options& o) {
    const auto start = std::chrono::steady_clock::now();
    if (!o.verbose) llama_log_set(quiet_log, nullptr);
    llama_backend_init();
    Model model(o.model_path);

    SweepConfig config;
    config.model_name = std::filesystem::path(o.model_path).filename().string();
    config.protocol = o.protocol;
    config.variants = o.variants;
    config.budgets = o.budgets;
    for (const std::string& label : o.policies) config.policies.emplace_back(label, model.get(), o.engine);
    config.kv_modes = o.kv_modes;
    check_policies(config.policies, o);

    const bool tasks_mode = !o.tasks_path.empty();
    const std::vector<Sample> samples =
        tasks_mode ? load_task_samples(model, o.tasks_path, o.samples, o.max_new_tokens)
                   : load_text_samples(model, o.text_path, o.ctx_tokens, o.cont_tokens, o.samples);
    const bool every_question_known =
        std::all_of(samples.begin(), samples.end(), [](const Sample& s) { return s.context_tokens > 0; });
    if (!o.variants_given && !every_question_known && config.variants.size() > 1) {
        config.variants = {kQuestionIncluded};
        std::fprintf(stderr, "[kvp-bench] %s has samples without a 'question' field: running question_included only "
                     "(regenerate the tasks with python -m kvp_cpp.ruler for question_excluded)\n", o.tasks_path.c_str());
    }

    ContextOptions context_options;
    context_options.n_ctx = cells_needed(samples, config.budgets);
    context_options.n_batch = o.n_batch;
    context_options.n_threads = o.n_threads;
    context_options.flash_attn = o.flash_attn;
    Session session(model, context_options);

    const std::string log_path = with_extension(o.output_path, ".samples.jsonl");
    const std::string csv_path = with_extension(o.output_path, ".csv");
    ResultLog log(log_path);
    if (log.skipped_lines() > 0)
        std::fprintf(stderr, "[kvp-bench] %s: ignored %lld unreadable line(s)\n", log_path.c_str(),
                     static_cast<long long>(log.skipped_lines()));
    const SweepCounters counters =
        run_sweep(session, samples, config, log, tasks_mode ? Evaluate(evaluate_answer) : Evaluate(evaluate_continuation));

    std::set<std::string> wanted;
    for (const RecordKey& key : sweep_keys(samples, config)) wanted.insert(key.str());
    std::vector<const json*> records;
    for (const json& record : log.records())
        if (wanted.count(RecordKey::of(record).str())) records.push_back(&record);
    std::vector<std::string> task_order;
    for (const Sample& s : samples)
        if (std::find(task_order.begin(), task_order.end(), s.task) == task_order.end()) task_order.push_back(s.task);
    const std::vector<ResultRow> rows = aggregate(records, config.variants, o.policies, task_order);

    const ModelIdentity identity = model_identity(model.get());
    json config_json = {{"protocol", protocol_name(o.protocol)},
                        {"variants", config.variants},
                        {"policies", policies_json(config.policies)},
                        {"budgets", o.budgets},
                        {"samples_per_task", o.samples},
                        {"max_new_tokens", o.max_new_tokens},
                        {"seed", o.engine.seed},
                        {"combine", head_combine_name(o.engine.combine)},
                        {"stretch", o.engine.stretch},
                        {"evict_fraction", o.engine.evict_fraction},
                        {"kv_modes", o.kv_modes},
                        {"head_consensus", head_consensus_json(o)},
                        {"scoring", scoring_path_name(o.engine.scoring)},
                        {"evict_unit", eviction_unit_name(o.engine.eviction_unit)},
                        {"threads", o.n_threads},
                        {"batch_size", o.n_batch},
                        {"flash_attn", o.flash_attn}};
    if (tasks_mode) config_json["tasks_file"] = o.tasks_path;
    else config_json.update(json{{"text_file", o.text_path}, {"ctx", o.ctx_tokens}, {"cont", o.cont_tokens}});

    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const json document = {
        {"schema", kSchema},
        {"mode", tasks_mode ? "tasks" : "perplexity"},
        {"model", {{"path", o.model_path}, {"name", config.model_name}, {"identity", identity_json(identity)},
                   {"kv_bytes_per_cell", model.kv_bytes_per_cell()}}},
        {"config", config_json},
        {"run", {{"wall_seconds", wall},
                 {"n_ctx", session.n_ctx()},
                 {"kv_bytes_allocated", session.n_ctx() * model.kv_bytes_per_cell()},
                 {"samples", int64_t(samples.size())},
                 {"shared_prefills", counters.shared_prefills},
                 {"shared_prefill_tokens", counters.shared_prefill_tokens},
                 {"shared_prefill_seconds", counters.shared_prefill_seconds},
                 {"decode_calls", session.counters().calls},
                 {"decoded_tokens", session.counters().tokens},
                 {"results_computed", counters.results_computed},
                 {"results_resumed", counters.results_resumed},
                 {"peak_rss_bytes", peak_rss_bytes()}}},
        {"files", {{"csv", csv_path}, {"log", log_path}}},
        {"results", rows}};
    std::ofstream out(o.output_path);
    out << json_text(document, 2) << '\n';
    if (!out) throw std::runtime_error("cannot write " + o.output_path);
    write_csv(csv_path, rows);

    print_table(std::cout, rows);
    std::fprintf(stderr, "[kvp-bench] %lld results (%lld resumed) in %s; wrote %s, %s, %s\n",
                 static_cast<long long>(counters.results_computed + counters.results_resumed),
                 static_cast<long long>(counters.results_resumed), format_duration(wall).c_str(),
                 o.output_path.c_str(), csv_path.c_str(), log_path.c_str());
    return 0;
}

}  // namespace
}  // namespace kvp::bench

int main(int argc, char** argv) {
    using namespace kvp::bench;
    try {
        const Options options = parse_args(argc, argv);
        if (!options.score_path.empty()) return score_predictions(options.score_path);
        if (options.speed) return run_speed_benchmark(options);
        return run_benchmark(options);
    } catch (const UsageError& e) {
        std::fprintf(stderr, "kvp-bench: %s (see kvp-bench --help)\n", e.what());
        return 2;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "kvp-bench: error: %s\n", e.what());
        return 1;
    }
}
