#include "sweep.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include "progress.h"

namespace kvp::bench {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

struct Job {
    const PolicyFactory* policy;
    int64_t budget;  // kUnbounded for full
    const std::string* variant;
    bool per_head = false;
    bool excludes_question() const { return *variant == kQuestionExcluded; }
};

std::vector<Job> all_jobs(const SweepConfig& config) {
    std::vector<Job> jobs;
    for (const std::string& variant : config.variants)
        for (const PolicyFactory& policy : config.policies) {
            if (policy.is_full()) {
                jobs.push_back({&policy, kUnbounded, &variant});  // no eviction: the same in every mode
                continue;
            }
            for (const std::string& mode : config.kv_modes)
                if (runs_in_mode(policy, mode, config.kv_modes))
                    for (int64_t budget : config.budgets)
                        jobs.push_back({&policy, budget, &variant, mode == kPerHeadMode});
        }
    return jobs;
}

// With per-head jobs in the run, shared engines keep original positions too: they share the llama_context, and
// llama.cpp cannot shift positions once per-head mode is on (compaction would only start near the model's training
// context anyway).
std::unique_ptr<Engine> engine_for(const SweepConfig& config, const Job& job, int64_t budget) {
    return job.policy->make_engine(budget, job.per_head, includes_per_head(config.kv_modes));
}

RecordKey key_of(const SweepConfig& config, const Sample& sample, const Job& job) {
    return {config.model_name, protocol_name(config.protocol), *job.variant, sample.task, sample.length,
            sample.index, job.policy->label(), job.budget, job.per_head ? kPerHeadMode : kSharedMode,
            job.per_head ? job.policy->per_head_consensus() : 0.0,
            job.policy->is_full() ? "token" : eviction_unit_name(job.policy->eviction_unit())};
}

std::string job_name(const SweepConfig& config, const Sample& sample, const Job& job) {
    std::string name = sample.task;
    name.append(" #").append(std::to_string(sample.index)).append(" ").append(display_label(job.policy->label()));
    if (job.budget != kUnbounded) name.append("@").append(std::to_string(job.budget));
    if (job.per_head) name.append(" per-head");
    if (config.variants.size() > 1) name.append(job.excludes_question() ? " (q excl)" : " (q incl)");
    return name;
}

// Where the compressed context of the question_excluded variant ends.
size_t question_start(const Sample& sample) {
    if (sample.context_tokens < 1 || sample.context_tokens >= int64_t(sample.prompt.size()))
        throw std::invalid_argument("sample " + sample.task + " #" + std::to_string(sample.index) +
                                    " has no question to exclude: its tasks file needs the 'question' field that "
                                    "python -m kvp_cpp.ruler writes");
    return size_t(sample.context_tokens);
}

class SweepRunner {
public:
    SweepRunner(Session& session, const SweepConfig& config, ResultLog& log, const Evaluate& evaluate, Progress& progress)
        : session_(session), config_(config), log_(log), evaluate_(evaluate), progress_(progress) {}

    void run_oneshot(const Sample& sample, const std::vector<Job>& jobs) {
        const std::span<const llama_token> prompt(sample.prompt);
        std::vector<size_t> excluded, included;
        for (size_t i = 0; i < jobs.size(); ++i) (jobs[i].excludes_question() ? excluded : included).push_back(i);
        const size_t held_back = prompt.size() - 1;  // question_included compresses all but the last token
        const size_t context_end = excluded.empty() ? held_back : question_start(sample);

        std::vector<std::unique_ptr<Engine>> engines(jobs.size());
        for (size_t i = 0; i < jobs.size(); ++i) {
            if (jobs[i].policy->is_full()) continue;
            engines[i] = engine_for(config_, jobs[i], std::max<int64_t>(int64_t(held_back), jobs[i].policy->min_budget()));
            engines[i]->attach(session_.context());
        }
        auto following = [&](const std::vector<size_t>& which) {
            std::vector<Engine*> out;
            for (size_t i : which)
                if (engines[i]) out.push_back(engines[i].get());
            return out;
        };
        std::vector<size_t> everyone = excluded;
        everyone.insert(everyone.end(), included.begin(), included.end());

        session_.clear_sequence();
        shared_prefill(following(everyone), prompt.first(context_end), 0);
        if (!excluded.empty()) {
            const std::vector<uint8_t> context = session_.save_sequence();
            compress_and_finish(sample, jobs, engines, excluded, context, prompt.subspan(context_end));
            if (!included.empty()) session_.restore_sequence(context);
        }
        if (!included.empty()) {
            shared_prefill(following(included), prompt.subspan(context_end, held_back - context_end), int64_t(context_end));
            const std::vector<uint8_t> prefilled = session_.save_sequence();
            compress_and_finish(sample, jobs, engines, included, prefilled, prompt.subspan(held_back));
        }
    }

    void run_bounded(const Sample& sample, const std::vector<Job>& jobs) {
        for (const Job& job : jobs) {
            const auto job_start = Clock::now();
            std::unique_ptr<Engine> engine;
            if (job.policy->is_full()) {
                session_.clear_sequence();
            } else {
                engine = engine_for(config_, job, job.budget);
                engine->attach(session_.context());  // clears the sequence
            }
            SequenceWriter writer(session_, engine ? std::vector<Engine*>{engine.get()} : std::vector<Engine*>{}, 0);
            finish(sample, job, writer, engine.get(), sample.prompt, job_start, -1);
        }
    }

    SweepCounters& counters() { return counters_; }

private:
    void shared_prefill(const std::vector<Engine*>& engines, std::span<const llama_token> tokens, int64_t next_pos) {
        if (tokens.empty()) return;
        const auto start = Clock::now();
        {
            SequenceWriter writer(session_, engines, next_pos);
            writer.feed(tokens);
        }
        counters_.shared_prefill_seconds += seconds_since(start);
        if (next_pos == 0) ++counters_.shared_prefills;
        counters_.shared_prefill_tokens += int64_t(tokens.size());
    }

    // Each of `which` jobs from the saved prefill: its engine compresses to the budget, then `unfed` and the answer
    // are appended to the compressed cache.
    void compress_and_finish(const Sample& sample, const std::vector<Job>& jobs,
                             std::vector<std::unique_ptr<Engine>>& engines, const std::vector<size_t>& which,
                             const std::vector<uint8_t>& prefilled, std::span<const llama_token> unfed) {
        const int64_t appended = int64_t(unfed.size() + sample.continuation.size()) + sample.max_new_tokens;
        const int64_t prefilled_length = int64_t(sample.prompt.size() - unfed.size());
        for (size_t i : which) {
            const auto job_start = Clock::now();
            session_.restore_sequence(prefilled);
            Engine* engine = engines[i].get();
            int64_t compressed_cells = prefilled_length;
            if (engine) {
                engine->compress(jobs[i].budget);
                compressed_cells = engine->stats().cells_used;
                int64_t opened = std::min(compressed_cells + appended, session_.n_ctx());
                if (engine->config().position_mode == PositionMode::compact)
                    opened = std::min(opened, engine->config().compact_limit);
                engine->set_budget(std::max(opened, jobs[i].budget));
            }
            {
                SequenceWriter writer(session_, engine ? std::vector<Engine*>{engine} : std::vector<Engine*>{},
                                      prefilled_length);
                finish(sample, jobs[i], writer, engine, unfed, job_start, compressed_cells);
            }
            engines[i].reset();  // its capture buffers and policy state are not needed any more
        }
    }

    void finish(const Sample& sample, const Job& job, SequenceWriter& writer, Engine* engine,
                std::span<const llama_token> unfed, Clock::time_point start, int64_t compressed_cells) {
        const Outcome outcome = evaluate_(sample, writer, unfed);
        json record;
        key_of(config_, sample, job).write_to(record);
        record["metric"] = sample.metric;
        record["score"] = outcome.score;
        record["prediction"] = outcome.prediction;
        if (!sample.outputs.empty()) record["outputs"] = sample.outputs;
        record["prompt_tokens"] = int64_t(sample.prompt.size());
        record["decoded_tokens"] = writer.decoded_tokens();
        record["generated_tokens"] = outcome.generated_tokens;
        record["context_tokens"] = int64_t(sample.prompt.size() - unfed.size());  // what was there to compress
        if (compressed_cells >= 0) record["compressed_cells"] = compressed_cells;  // oneshot: right after compress
        record["cells_max"] = writer.max_cells();
        record["llama_cells"] = session_.cells_in_use();
        record["tokens_evicted"] = engine ? engine->stats().tokens_evicted : 0;
        record["kept_digest"] = writer.kept_digest();
        if (!job.policy->file_digest().empty()) record["policy_digest"] = job.policy->file_digest();
        record["seconds"] = seconds_since(start);
        log_.append(record);
        ++counters_.results_computed;
        progress_.done(job_name(config_, sample, job));
    }

    Session& session_;
    const SweepConfig& config_;
    ResultLog& log_;
    const Evaluate& evaluate_;
    Progress& progress_;
    SweepCounters counters_;
};

}  // namespace

Protocol protocol_from_name(const std::string& name) {
    if (name == "oneshot") return Protocol::oneshot;
    if (name == "bounded") return Protocol::bounded;
    throw std::invalid_argument("--protocol must be oneshot or bounded, not '" + name + "'");
}

const char* protocol_name(Protocol protocol) { return protocol == Protocol::oneshot ? "oneshot" : "bounded"; }

int64_t cells_needed(const std::vector<Sample>& samples, const std::vector<int64_t>& budgets) {
    int64_t cells = budgets.empty() ? 0 : *std::max_element(budgets.begin(), budgets.end());
    for (const Sample& s : samples)
        cells = std::max(cells, int64_t(s.prompt.size() + s.continuation.size()) + s.max_new_tokens);
    return cells + 1;
}

std::vector<RecordKey> sweep_keys(const std::vector<Sample>& samples, const SweepConfig& config) {
    std::vector<RecordKey> keys;
    for (const Sample& sample : samples)
        for (const Job& job : all_jobs(config)) keys.push_back(key_of(config, sample, job));
    return keys;
}

static void check_policy_files_unchanged(const ResultLog& log, const std::vector<PolicyFactory>& policies) {
    for (const PolicyFactory& policy : policies) {
        const std::string& digest = policy.file_digest();
        if (digest.empty()) continue;
        for (const json& record : log.records()) {
            // logs written before the digest was recorded cannot be checked
            if (record.value("policy", "") != policy.label() || !record.contains("policy_digest")) continue;
            const std::string logged = record["policy_digest"].get<std::string>();
            if (logged != digest)
                throw std::invalid_argument(log.path() + " holds results of " + policy.label() +
                                            " from another version of the file (digest " + logged + ", the file's is " +
                                            digest + " now): use another -o, or delete that policy's lines to "
                                            "recompute them");
        }
    }
}

SweepCounters run_sweep(Session& session, const std::vector<Sample>& samples, const SweepConfig& config,
                        ResultLog& log, const Evaluate& evaluate) {
    check_policy_files_unchanged(log, config.policies);
    const std::vector<Job> jobs = all_jobs(config);
    std::vector<std::vector<Job>> pending(samples.size());
    int64_t total = 0, resumed = 0;
    for (size_t s = 0; s < samples.size(); ++s) {
        if (samples[s].prompt.empty()) throw std::invalid_argument("sample " + samples[s].task + " #" +
                                                                   std::to_string(samples[s].index) + " has no tokens");
        for (const Job& job : jobs) {
            if (log.has(key_of(config, samples[s], job))) ++resumed;
            else pending[s].push_back(job);
        }
        total += int64_t(pending[s].size());
    }

    Progress progress(total);
    SweepRunner runner(session, config, log, evaluate, progress);
    runner.counters().results_resumed = resumed;
    for (size_t s = 0; s < samples.size(); ++s) {
        if (pending[s].empty()) continue;
        if (config.protocol == Protocol::oneshot) runner.run_oneshot(samples[s], pending[s]);
        else runner.run_bounded(samples[s], pending[s]);
    }
    progress.finish();
    return runner.counters();
}

}  // namespace kvp::bench
