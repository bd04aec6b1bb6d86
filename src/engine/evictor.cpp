#include "kvp/evictor.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

namespace kvp {

HeadCombine head_combine_from_name(const std::string& name) {
    for (HeadCombine c : {HeadCombine::sum_softmax, HeadCombine::max_softmax, HeadCombine::mean, HeadCombine::mean_rank})
        if (name == head_combine_name(c)) return c;
    throw std::invalid_argument("unknown head combination '" + name + "' (sum_softmax, max_softmax, mean, mean_rank)");
}

const char* head_combine_name(HeadCombine combine) {
    switch (combine) {
        case HeadCombine::sum_softmax: return "sum_softmax";
        case HeadCombine::max_softmax: return "max_softmax";
        case HeadCombine::mean: return "mean";
        case HeadCombine::mean_rank: return "mean_rank";
    }
    return "unknown";
}

EvictionUnit eviction_unit_from_name(const std::string& name) {
    for (EvictionUnit u : {EvictionUnit::token, EvictionUnit::word})
        if (name == eviction_unit_name(u)) return u;
    throw std::invalid_argument("unknown eviction unit '" + name + "' (token, word)");
}

const char* eviction_unit_name(EvictionUnit unit) { return unit == EvictionUnit::word ? "word" : "token"; }

void share_word_scores(Ledger& ledger) {
    const int n_columns = ledger.n_columns();
    // entries are in logical order, so a word's cached tokens are adjacent
    for (size_t first = 0; first < ledger.size();) {
        size_t end = first + 1;
        while (end < ledger.size() && ledger.word(end) == ledger.word(first)) ++end;
        if (end - first > 1)
            for (int c = 0; c < n_columns; ++c) {
                float best = -INFINITY;
                for (size_t i = first; i < end; ++i)
                    if (std::isfinite(ledger.scores(i)[c])) best = std::max(best, ledger.scores(i)[c]);
                for (size_t i = first; i < end; ++i)
                    if (std::isfinite(ledger.scores(i)[c])) ledger.scores(i)[c] = best;
            }
        first = end;
    }
}

namespace {

// x becomes softmax(x), shifted by its largest value; -inf entries get 0, and all of them 0 when none is finite.
void softmax_in_place(std::vector<double>& x) {
    const double peak = x.empty() ? -INFINITY : *std::max_element(x.begin(), x.end());
    double total = 0.0;
    for (double& v : x) total += (v = std::isfinite(peak) ? std::exp(v - peak) : 0.0);
    if (total > 0.0)
        for (double& v : x) v /= total;
}

}  // namespace

std::vector<size_t> eviction_candidates(const Ledger& ledger, Protection protection) {
    std::vector<size_t> candidates;
    const size_t end = ledger.size() > protection.n_recent ? ledger.size() - protection.n_recent : 0;
    for (size_t i = ledger.lower_bound(protection.n_sink); i < end; ++i) candidates.push_back(i);
    return candidates;
}

std::vector<double> combined_keep_scores(const Ledger& ledger, const std::vector<size_t>& candidates,
                                         HeadCombine combine) {
    std::vector<int> every(static_cast<size_t>(ledger.n_columns()));
    std::iota(every.begin(), every.end(), 0);
    return combined_keep_scores(ledger, candidates, combine, every);
}

std::vector<double> combined_keep_scores(const Ledger& ledger, const std::vector<size_t>& candidates,
                                         HeadCombine combine, const std::vector<int>& columns) {
    const size_t n = candidates.size();
    const int n_columns = int(columns.size());
    for (int c : columns)
        if (c < 0 || c >= ledger.n_columns())
            throw std::invalid_argument("score column " + std::to_string(c) + " out of range (the ledger has " +
                                        std::to_string(ledger.n_columns()) + ")");
    std::vector<double> keep(n, combine == HeadCombine::max_softmax ? -INFINITY : 0.0);
    if (n == 0) return keep;
    // A candidate with a NaN or infinite score in any column (a hostile or overflowing policy) gets the lowest
    // keep-score, -inf, and takes no part in the combination: the others are combined as if it were absent, so a
    // single NaN cannot poison a softmax, a mean or a sort.
    std::vector<size_t> finite;  // positions in `candidates` whose every score is finite
    finite.reserve(n);
    for (size_t i = 0; i < n; ++i) {
        const float* row = ledger.scores(candidates[i]);
        if (std::all_of(columns.begin(), columns.end(), [row](int c) { return std::isfinite(row[c]); }))
            finite.push_back(i);
        else
            keep[i] = -INFINITY;
    }
    const size_t m = finite.size();
    if (m == 0) return keep;
    std::vector<double> column(m);
    std::vector<size_t> order(m);
    for (int c : columns) {
        for (size_t j = 0; j < m; ++j) column[j] = ledger.scores(candidates[finite[j]])[c];
        switch (combine) {
            case HeadCombine::sum_softmax:
            case HeadCombine::max_softmax: {
                softmax_in_place(column);
                for (size_t j = 0; j < m; ++j) {
                    double& k = keep[finite[j]];
                    k = combine == HeadCombine::sum_softmax ? k + column[j] : std::max(k, column[j]);
                }
                break;
            }
            case HeadCombine::mean:
                for (size_t j = 0; j < m; ++j) keep[finite[j]] += column[j] / n_columns;
                break;
            case HeadCombine::mean_rank: {
                std::iota(order.begin(), order.end(), size_t(0));
                std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return column[a] < column[b]; });
                for (size_t r = 0; r < m; ++r) keep[finite[order[r]]] += double(r) / n_columns;
                break;
            }
        }
    }
    return keep;
}

void check_stretch(double stretch, HeadCombine combine) {
    if (!(stretch >= 0.0) || !std::isfinite(stretch))
        throw std::invalid_argument("the stretch must be a finite number >= 0, got " + std::to_string(stretch));
    if (stretch != 0.0 && combine != HeadCombine::sum_softmax && combine != HeadCombine::max_softmax)
        throw std::invalid_argument(std::string("the stretch needs a softmax head combination (keep-scores >= 0), not ") +
                                    head_combine_name(combine));
}

size_t stretch_length(const Ledger& ledger, const std::vector<size_t>& candidates, const std::vector<double>& keep,
                      size_t n_evict, double stretch) {
    if (stretch == 0.0 || n_evict >= candidates.size()) return 0;
    double total = 0.0;
    size_t n_finite = 0;
    for (double k : keep)
        if (std::isfinite(k)) total += k, ++n_finite;
    if (n_finite == 0) return 0;
    const double threshold = stretch * total / double(n_finite);
    const size_t confident = size_t(std::count_if(keep.begin(), keep.end(), [&](double k) {
        return std::isfinite(k) && k >= threshold;
    }));
    const size_t n_keep = candidates.size() - n_evict;
    size_t length = n_keep > confident ? n_keep - confident : 0;
    while (length > 0 && length < candidates.size() &&
           ledger.word(candidates[length]) == ledger.word(candidates[length - 1]))
        --length;  // the stretch ends where a word does
    return length;
}

std::vector<size_t> select_victims(const Ledger& ledger, Protection protection, size_t n_evict, HeadCombine combine,
                                   double stretch) {
    const std::vector<size_t> candidates = eviction_candidates(ledger, protection);
    if (n_evict > candidates.size())
        throw std::logic_error("cannot evict " + std::to_string(n_evict) + " tokens: only " +
                               std::to_string(candidates.size()) + " are not protected");
    check_stretch(stretch, combine);
    const std::vector<double> keep = combined_keep_scores(ledger, candidates, combine);
    const size_t kept_whole = stretch_length(ledger, candidates, keep, n_evict, stretch);
    std::vector<size_t> order(candidates.size() - kept_whole);
    std::iota(order.begin(), order.end(), kept_whole);
    // Candidates are in logical order, so comparing positions in `order` breaks ties towards the older token.
    auto lower_keep = [&](size_t a, size_t b) { return keep[a] < keep[b] || (keep[a] == keep[b] && a < b); };
    std::nth_element(order.begin(), order.begin() + n_evict, order.end(), lower_keep);
    std::vector<size_t> victims;
    victims.reserve(n_evict);
    for (size_t r = 0; r < n_evict; ++r) victims.push_back(candidates[order[r]]);
    std::sort(victims.begin(), victims.end());
    return victims;
}

std::vector<std::vector<size_t>> select_victims_per_head(const Ledger& ledger, Protection protection, size_t n_evict,
                                                         double consensus, std::vector<int> head_columns) {
    const int n_heads = ledger.n_holders();
    if (n_heads <= 0) throw std::logic_error("select_victims_per_head on a shared-mode ledger");
    if (head_columns.empty()) {
        if (ledger.n_columns() != 1 && ledger.n_columns() != n_heads)
            throw std::invalid_argument("per-head eviction needs one score column per (layer, KV head) (" +
                                        std::to_string(n_heads) + ") or a token-level policy; the policy has " +
                                        std::to_string(ledger.n_columns()));
        head_columns.resize(static_cast<size_t>(n_heads));
        for (int h = 0; h < n_heads; ++h) head_columns[size_t(h)] = ledger.n_columns() == 1 ? 0 : h;
    } else if (head_columns.size() != static_cast<size_t>(n_heads)) {
        throw std::invalid_argument("per-head eviction got " + std::to_string(head_columns.size()) +
                                    " head columns for " + std::to_string(n_heads) + " heads");
    }
    for (int c : head_columns)
        if (c < 0 || c >= ledger.n_columns())
            throw std::invalid_argument("head column " + std::to_string(c) + " out of range (the policy has " +
                                        std::to_string(ledger.n_columns()) + " score columns)");
    if (!(consensus >= 0.0 && consensus <= 1.0))
        throw std::invalid_argument("head consensus must be in [0, 1], got " + std::to_string(consensus));
    const std::vector<size_t> candidates = eviction_candidates(ledger, protection);
    std::vector<int> vote_columns = head_columns;  // the columns of the heads, each once
    std::sort(vote_columns.begin(), vote_columns.end());
    vote_columns.erase(std::unique(vote_columns.begin(), vote_columns.end()), vote_columns.end());
    // When every head ranks by the same column there is nothing to mix.
    const bool mixed = consensus > 0.0 && vote_columns.size() > 1;
    // per candidate: the sum over the heads' columns of each one's softmax, what shared mode ranks by
    const std::vector<double> votes =
        mixed ? combined_keep_scores(ledger, candidates, HeadCombine::sum_softmax, vote_columns) : std::vector<double>();
    std::vector<std::vector<size_t>> victims(static_cast<size_t>(n_heads));
    std::vector<size_t> mine;     // ledger indices this head holds
    std::vector<double> key;      // their keep-scores, lowest leaves first
    std::vector<double> vote_of_mine;
    std::vector<size_t> order;
    for (int h = 0; h < n_heads; ++h) {
        const int column = head_columns[size_t(h)];
        mine.clear();
        key.clear();
        vote_of_mine.clear();
        for (size_t c = 0; c < candidates.size(); ++c) {
            const size_t i = candidates[c];
            if (!ledger.held(i, h)) continue;
            mine.push_back(i);
            const float x = ledger.scores(i)[column];
            key.push_back(std::isfinite(x) ? double(x) : -INFINITY);
            if (mixed) vote_of_mine.push_back(votes[c]);
        }
        if (n_evict > mine.size())
            throw std::logic_error("cannot evict " + std::to_string(n_evict) + " tokens from head " + std::to_string(h) +
                                   ": it holds only " + std::to_string(mine.size()) + " unprotected ones");
        if (mixed) {
            // n_heads x ((1 - w) x this head's softmax over what it holds + w x the heads' mean vote): both parts
            // sum to about 1, so w is the share of the ranking that follows the other heads. Scaled by n_heads
            // so that w = 1 gives shared mode's keep-scores bit for bit.
            softmax_in_place(key);
            for (size_t j = 0; j < key.size(); ++j)
                key[j] = std::isinf(vote_of_mine[j]) ? -INFINITY
                                                     : (1.0 - consensus) * n_heads * key[j] + consensus * vote_of_mine[j];
        }
        order.resize(mine.size());
        std::iota(order.begin(), order.end(), size_t(0));
        // mine is in logical order, so comparing positions in it breaks ties towards the older token
        auto lower = [&](size_t a, size_t b) { return key[a] < key[b] || (key[a] == key[b] && a < b); };
        std::nth_element(order.begin(), order.begin() + n_evict, order.end(), lower);
        std::vector<size_t>& out = victims[size_t(h)];
        for (size_t r = 0; r < n_evict; ++r) out.push_back(mine[order[r]]);
        std::sort(out.begin(), out.end());
    }
    return victims;
}

}  // namespace kvp
