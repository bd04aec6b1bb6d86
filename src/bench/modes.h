// The two ways a sample is scored. Task accuracy: RULER JSONL samples (python -m kvp_cpp.ruler), greedy
// generation after the answer prefix, RULER's metrics. Perplexity: windows of a text, the mean negative
// log-likelihood of a teacher-forced continuation after a compressed context.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "sweep.h"

namespace kvp::bench {

// Samples of a RULER JSONL file (fields input, answer_prefix, outputs, metric, max_new_tokens, task, index,
// target_length), at most max_per_task per (task, length) (0: all); max_new_tokens > 0 overrides the samples'.
std::vector<Sample> load_task_samples(const Model& model, const std::string& path, int64_t max_per_task,
                                      int64_t max_new_tokens);

// Greedy generation of up to max_new_tokens (stopping at an end-of-generation token), scored with the metric.
Outcome evaluate_answer(const Sample& sample, SequenceWriter& writer, std::span<const llama_token> unfed);

// Consecutive windows of ctx_tokens + cont_tokens tokens of a text file, at most max_windows (0: all that fit).
std::vector<Sample> load_text_samples(const Model& model, const std::string& path, int64_t ctx_tokens,
                                      int64_t cont_tokens, int64_t max_windows);

// The mean negative log-likelihood (nats per token) of the continuation, teacher-forced.
Outcome evaluate_continuation(const Sample& sample, SequenceWriter& writer, std::span<const llama_token> unfed);

}  // namespace kvp::bench
