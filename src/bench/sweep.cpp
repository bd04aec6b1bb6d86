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
};

std::vector<Job> all_jobs(const SweepConfig& config) {
    std::vector<Job> jobs;
    for (const PolicyFactory& policy : config.policies) {
        if (policy.is_full()) jobs.push_back({&policy, kUnbounded});
        else
            for (int64_t budget : config.budgets) jobs.push_back({&policy, budget});
    }
    return jobs;
}

RecordKey key_of(const SweepConfig& config, const Sample& sample, const Job& job) {
    return {config.model_name, protocol_name(config.protocol), config.variant, sample.task, sample.length,
            sample.index, job.policy->label(), job.budget};
}

std::string job_name(const Sample& sample, const Job& job) {
    std::string name = sample.task;
    name.append(" #").append(std::to_string(sample.index)).append(" ").append(job.policy->label());
    if (job.budget != kUnbounded) name.append("@").append(std::to_string(job.budget));
    return name;
}

class SweepRunner {
public:
    SweepRunner(Session& session, const SweepConfig& config, ResultLog& log, const Evaluate& evaluate, Progress& progress)
        : session_(session), config_(config), log_(log), evaluate_(evaluate), progress_(progress) {}

    void run_oneshot(const Sample& sample, const std::vector<Job>& jobs) {
        const std::span<const llama_token> prompt(sample.prompt);
        const auto prefix = prompt.first(prompt.size() - 1), held_back = prompt.last(1);

        std::vector<std::unique_ptr<Engine>> engines(jobs.size());
        std::vector<Engine*> following;
        for (size_t i = 0; i < jobs.size(); ++i) {
            if (jobs[i].policy->is_full()) continue;
            engines[i] = jobs[i].policy->make_engine(std::max<int64_t>(int64_t(prefix.size()), jobs[i].policy->min_budget()));
            engines[i]->attach(session_.context());
            following.push_back(engines[i].get());
        }
        session_.clear_sequence();
        const auto start = Clock::now();
        {
            SequenceWriter writer(session_, following, 0);
            writer.feed(prefix);
        }
        counters_.shared_prefill_seconds += seconds_since(start);
        ++counters_.shared_prefills;
        counters_.shared_prefill_tokens += int64_t(prefix.size());
        const std::vector<uint8_t> prefilled = session_.save_sequence();

        for (size_t i = 0; i < jobs.size(); ++i) {
            const auto job_start = Clock::now();
            session_.restore_sequence(prefilled);
            Engine* engine = engines[i].get();
            if (engine) engine->compress(jobs[i].budget);
            {
                SequenceWriter writer(session_, engine ? std::vector<Engine*>{engine} : std::vector<Engine*>{},
                                      int64_t(prefix.size()));
                finish(sample, jobs[i], writer, engine, held_back, job_start);
            }
            engines[i].reset();  // its capture buffers and policy state are not needed any more
        }
    }

    void run_bounded(const Sample& sample, const std::vector<Job>& jobs) {
        for (const Job& job : jobs) {
            const auto job_start = Clock::now();
            std::unique_ptr<Engine> engine;
            if (job.policy->is_full()) {
                session_.clear_sequence();
            } else {
                engine = job.policy->make_engine(job.budget);
                engine->attach(session_.context());  // clears the sequence
            }
            SequenceWriter writer(session_, engine ? std::vector<Engine*>{engine.get()} : std::vector<Engine*>{}, 0);
            finish(sample, job, writer, engine.get(), sample.prompt, job_start);
        }
    }

    SweepCounters& counters() { return counters_; }

private:
    void finish(const Sample& sample, const Job& job, SequenceWriter& writer, Engine* engine,
                std::span<const llama_token> unfed, Clock::time_point start) {
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
        record["cells_max"] = writer.max_cells();
        record["llama_cells"] = session_.cells_in_use();
        record["tokens_evicted"] = engine ? engine->stats().tokens_evicted : 0;
        record["kept_digest"] = writer.kept_digest();
        record["seconds"] = seconds_since(start);
        log_.append(record);
        ++counters_.results_computed;
        progress_.done(job_name(sample, job));
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

SweepCounters run_sweep(Session& session, const std::vector<Sample>& samples, const SweepConfig& config,
                        ResultLog& log, const Evaluate& evaluate) {
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
