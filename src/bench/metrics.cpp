#include "metrics.h"

#include <algorithm>
#include <stdexcept>

namespace kvp::bench {

namespace {

bool is_space_or_control(unsigned char c) { return c <= 0x20; }

std::string strip(const std::string& s) {
    size_t begin = 0, end = s.size();
    while (begin < end && is_space_or_control(static_cast<unsigned char>(s[begin]))) ++begin;
    while (end > begin && is_space_or_control(static_cast<unsigned char>(s[end - 1]))) --end;
    return s.substr(begin, end - begin);
}

std::string ascii_lower(std::string s) {
    for (char& c : s)
        if (c >= 'A' && c <= 'Z') c = char(c - 'A' + 'a');
    return s;
}

bool contains_folded(const std::string& folded_prediction, const std::string& reference) {
    return folded_prediction.find(ascii_lower(reference)) != std::string::npos;
}

}  // namespace

// Python's strip() removes whitespace, and every ASCII control character becomes '\n' before the second strip,
// so stripping all bytes <= 0x20 at both ends gives the same result.
std::string postprocess_prediction(const std::string& prediction) {
    std::string out = strip(prediction);
    for (char& c : out)
        if (static_cast<unsigned char>(c) < 0x20) c = '\n';
    return strip(out);
}

double match_all(const std::string& prediction, const std::vector<std::string>& references) {
    if (references.empty()) throw std::invalid_argument("a sample needs at least one reference");
    const std::string folded = ascii_lower(prediction);
    const auto found = std::count_if(references.begin(), references.end(),
                                     [&](const std::string& r) { return contains_folded(folded, r); });
    return double(found) / double(references.size());
}

double match_part(const std::string& prediction, const std::vector<std::string>& references) {
    if (references.empty()) throw std::invalid_argument("a sample needs at least one reference");
    const std::string folded = ascii_lower(prediction);
    return std::any_of(references.begin(), references.end(),
                       [&](const std::string& r) { return contains_folded(folded, r); })
               ? 1.0
               : 0.0;
}

bool is_known_metric(const std::string& metric) {
    return metric == "string_match_all" || metric == "string_match_part";
}

double sample_score(const std::string& metric, const std::string& prediction, const std::vector<std::string>& references) {
    const std::string clean = postprocess_prediction(prediction);
    if (metric == "string_match_all") return 100.0 * match_all(clean, references);
    if (metric == "string_match_part") return 100.0 * match_part(clean, references);
    throw std::invalid_argument("unknown metric '" + metric + "' (string_match_all, string_match_part)");
}

}  // namespace kvp::bench
