// The sweep: every sample against every (policy, budget), under the oneshot or the bounded protocol.
//
// oneshot (the KV Policy paper's protocol, C.5, and kvpress's): the prompt is prefilled once per sample with an
// engine per pending (variant, policy, budget) following the same llama_decode calls (the session forwards the
// eval callback to all of them), so each engine has observed and scored its part of the prefill exactly as if it
// had run alone. The sequence state is saved (llama_state_seq_get_data) where a variant compresses; for each
// (policy, budget) it is restored (llama_state_seq_set_data), that engine compresses the cache to the budget, the
// budget is raised by what is still to come (the rest of the prompt and the answer are appended to the compressed
// cache, not evicted), and the sample is finished from there.
//   question_included: the compressed context is the whole prompt but its last token, which is held back and
//     decoded after compression, so every logit that is scored comes from the compressed cache;
//   question_excluded: the compressed context stops before the sample's question (kvpress's default); the
//     question and the answer prefix are decoded after compression.
// The context is prefilled once for both variants (the question_included engines then also read the question).
// A sample costs one prefill whatever the number of policies, budgets and variants; the run's counters
// (shared_prefill_tokens, and decoded_tokens per result) show it.
//
// bounded: a fresh engine per (policy, budget) holds the cache to the budget from the first token, with chunked
// prefill, as kvp_cpp.Llama does; each (policy, budget) costs a prefill.
//
// `full` needs no engine: the uncompressed reference, from the same saved prefill in oneshot.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "policies.h"
#include "results.h"
#include "session.h"

namespace kvp::bench {

enum class Protocol { oneshot, bounded };
Protocol protocol_from_name(const std::string& name);  // throws std::invalid_argument
const char* protocol_name(Protocol protocol);

// A sample of either mode. Task accuracy: the RULER prompt (input + answer_prefix) and its references;
// perplexity: a window of text, the context as prompt and the continuation to score.
struct Sample {
    std::string task;
    int64_t length = 0;  // RULER's target length; the context length in perplexity mode
    int64_t index = 0;
    std::string metric;  // string_match_all, string_match_part, mean_nll
    std::vector<llama_token> prompt;
    std::vector<std::string> outputs;
    int64_t max_new_tokens = 0;
    std::vector<llama_token> continuation;
    int64_t context_tokens = -1;  // prompt tokens before the question (question_excluded); -1: not known
};

constexpr const char* kQuestionIncluded = "question_included";
constexpr const char* kQuestionExcluded = "question_excluded";
constexpr const char* kContinuation = "continuation";  // perplexity: the context is the prompt, as question_included

struct Outcome {
    double score = 0;
    std::string prediction;
    int64_t generated_tokens = 0;  // tokens generated (or, in perplexity mode, scored) after the prompt
};

// Finishes a sample from a cache that holds the prompt except `unfed`, which it feeds first.
using Evaluate = std::function<Outcome(const Sample& sample, SequenceWriter& writer, std::span<const llama_token> unfed)>;

struct SweepConfig {
    std::string model_name;  // part of every record's key
    Protocol protocol = Protocol::oneshot;
    std::vector<std::string> variants;  // oneshot: kQuestionIncluded / kQuestionExcluded; else one name
    std::vector<PolicyFactory> policies;
    std::vector<int64_t> budgets;  // ascending; `full` ignores them
    std::vector<std::string> kv_modes = {kSharedMode};  // kSharedMode / kPerHeadMode: every policy runs in each
};

struct SweepCounters {
    int64_t shared_prefills = 0;        // oneshot prefills (one per sample with pending results)
    int64_t shared_prefill_tokens = 0;  // tokens decoded by them
    double shared_prefill_seconds = 0;
    int64_t results_computed = 0;
    int64_t results_resumed = 0;  // found in the log
};

// The largest number of cells a sample needs: the whole prompt plus what follows it, or the largest budget.
int64_t cells_needed(const std::vector<Sample>& samples, const std::vector<int64_t>& budgets);

// Every record key the sweep produces, for aggregating only this run's part of a shared log.
std::vector<RecordKey> sweep_keys(const std::vector<Sample>& samples, const SweepConfig& config);

SweepCounters run_sweep(Session& session, const std::vector<Sample>& samples, const SweepConfig& config,
                        ResultLog& log, const Evaluate& evaluate);

}  // namespace kvp::bench
