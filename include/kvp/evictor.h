// The evictor, shared by every policy: protected tokens, combining per-head scores into one keep-score per token
// (llama.cpp's cells are shared by all heads), and choosing which tokens leave.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvp/ledger.h"

namespace kvp {

enum class HeadCombine {
    sum_softmax,  // sum over columns of each column's softmax over the candidates (default)
    max_softmax,  // max over columns of the same softmax
    mean,         // mean raw score
    mean_rank,    // mean per-column rank (scale-free)
};

HeadCombine head_combine_from_name(const std::string& name);  // throws std::invalid_argument
const char* head_combine_name(HeadCombine combine);

// What one eviction decision covers. Sub-word tokens of one word carry the word only together: a model shown
// half of a word reads another word (docs/policies.md, "Word-level eviction").
enum class EvictionUnit {
    token,  // every token ranked by its own score (default)
    word,   // every token ranked by the highest score among the cached tokens of its word
};
EvictionUnit eviction_unit_from_name(const std::string& name);  // token, word; throws std::invalid_argument
const char* eviction_unit_name(EvictionUnit unit);

// Word-level eviction: in every score column, each entry gets the highest finite score among the entries of its
// word (Ledger::word). Non-finite scores stay as they are, so such entries still leave first.
void share_word_scores(Ledger& ledger);

struct Protection {
    uint32_t n_sink = 4;    // tokens with logical index < n_sink stay
    uint32_t n_recent = 16; // the n_recent newest entries stay
};

// Ledger indices that may be evicted.
std::vector<size_t> eviction_candidates(const Ledger& ledger, Protection protection);

// One keep-score per candidate (same order as `candidates`). A candidate with a non-finite score (NaN, +inf or
// -inf) in any column gets -inf, the lowest keep-score, and the others are combined as if it were absent.
std::vector<double> combined_keep_scores(const Ledger& ledger, const std::vector<size_t>& candidates,
                                         HeadCombine combine);
// The same over the listed score columns only (ascending, each once).
std::vector<double> combined_keep_scores(const Ledger& ledger, const std::vector<size_t>& candidates,
                                         HeadCombine combine, const std::vector<int>& columns);

// The n_evict candidates with the lowest keep-score, as ascending ledger indices. Ties go to the older token
// (smaller logical index), so the order is deterministic; tokens with a non-finite score leave first, oldest first.
// Throws std::logic_error if too few candidates exist.
//
// stretch > 0 (a softmax combination only): the candidates whose keep-score is at least `stretch` times the mean
// keep-score are the ranking's confident picks. What the kept candidates do not need for them goes to an unbroken
// stretch of the oldest candidates, kept whole (not splitting a word), and the victims are the lowest keep-scores
// among the candidates after it. A ranking that scores tokens one by one keeps scattered tokens where nothing
// stands out, and counting a text's words needs an unbroken part of it (models/README.md, "What fwe needs").
std::vector<size_t> select_victims(const Ledger& ledger, Protection protection, size_t n_evict, HeadCombine combine,
                                   double stretch = 0.0);
// Throws std::invalid_argument unless stretch is finite and >= 0, and, when it is not 0, combine is a softmax one.
void check_stretch(double stretch, HeadCombine combine);
// The length of that stretch, in candidates; 0 with stretch 0. stretch as check_stretch accepts it.
size_t stretch_length(const Ledger& ledger, const std::vector<size_t>& candidates, const std::vector<double>& keep,
                      size_t n_evict, double stretch);

// Per-head mode (the ledger has holders): for every head h, the n_evict candidates that h still holds with h's
// lowest keep-scores, as ascending ledger indices; victims[h]. With consensus 0 a head's keep-score is its own
// score (column h, or column 0 for a one-column policy). With consensus w in (0, 1] it is
// (1 - w) x softmax of h's scores over what h holds + w x the mean over heads of each head's softmax over all
// candidates (shared mode's sum_softmax / n_heads), so tokens that many heads want are kept by every head;
// w = 1 from a common start evicts exactly what shared mode would. Same tie and non-finite rules as
// select_victims. head_columns[h] names head h's score column where the policy scores more heads than the cache
// evicts per head (Gemma 3: every layer scored, only the full-attention ones per head); the vote then sums over
// those columns only. Empty: column h, or column 0 for a one-column policy. Throws std::logic_error if a head
// holds too few candidates, std::invalid_argument if the policy's columns are neither 1 nor one per head (without
// head_columns), a head column is out of range, or w is outside [0, 1].
std::vector<std::vector<size_t>> select_victims_per_head(const Ledger& ledger, Protection protection, size_t n_evict,
                                                         double consensus = 0.0, std::vector<int> head_columns = {});

}  // namespace kvp
