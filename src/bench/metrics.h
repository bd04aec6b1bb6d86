// RULER's text-match metrics (scripts/eval/synthetic/constants.py, scripts/eval/evaluate.py), as in
// kvp_cpp.metrics: predictions are post-processed (strip, control characters [\x00-\x1f] -> '\n', strip), then
// references are looked up as case-insensitive substrings. Case folding is ASCII-only, which changes nothing for
// RULER's answers (numbers, UUIDs, English words); Python's str.lower() also folds non-ASCII letters.
#pragma once

#include <string>
#include <vector>

namespace kvp::bench {

std::string postprocess_prediction(const std::string& prediction);

// One already post-processed prediction: the fraction of references found (string_match_all), or 1 if any is
// found (string_match_part).
double match_all(const std::string& prediction, const std::vector<std::string>& references);
double match_part(const std::string& prediction, const std::vector<std::string>& references);

bool is_known_metric(const std::string& metric);

// The score of one raw prediction in percent (0..100): post-process, then the metric named by a RULER sample.
// RULER's per-task score is the mean of these over samples, rounded to 2 decimals. Throws std::invalid_argument
// for an unknown metric or an empty reference list.
double sample_score(const std::string& metric, const std::string& prediction, const std::vector<std::string>& references);

}  // namespace kvp::bench
