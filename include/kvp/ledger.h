// The ledger: one entry per token held in the KV cache of one sequence, in logical order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvp {

class Ledger {
public:
    explicit Ledger(int n_columns = 1) : n_columns_(n_columns) {}

    size_t size() const { return logical_.size(); }
    bool empty() const { return logical_.empty(); }
    int n_columns() const { return n_columns_; }

    // Appends a token; its score row starts at zero. `word` is the logical index of the first token of the word it
    // belongs to (itself by default), `token` its vocabulary id (-1: not known); see set_word_groups().
    void append(int64_t logical, int64_t original_pos, int64_t cache_pos, int64_t word = -1, int32_t token = -1);
    // Removes the entries whose indices are listed (ascending, unique).
    void remove(const std::vector<size_t>& sorted_indices);
    // Removes every entry from index `first` on.
    void truncate(size_t first);
    void clear() { truncate(0); }

    int64_t logical(size_t i) const { return logical_[i]; }
    int64_t original_pos(size_t i) const { return original_pos_[i]; }
    int64_t cache_pos(size_t i) const { return cache_pos_[i]; }
    void set_cache_pos(size_t i, int64_t pos) { cache_pos_[i] = pos; }
    // Per-head mode: which heads (columns of the per-head KV cache, layer-major) still hold each entry. An entry
    // stays while any head holds it. n_holders = 0 (the default) is the shared mode, where every entry is held by
    // every head. set_holders() is for an empty ledger; append() makes a new entry held by every head.
    void set_holders(int n_holders);
    int n_holders() const { return n_holders_; }
    bool held(size_t i, int head) const { return n_holders_ == 0 || holders_[i * n_holders_ + head] != 0; }
    void release(size_t i, int head) { holders_[i * n_holders_ + head] = 0; }
    bool held_by_any(size_t i) const;
    // Entries in [first, last) that `head` holds (the whole range in shared mode).
    size_t held_count(int head, size_t first, size_t last) const;

    // Word-level eviction: entries of one word (the same word()) are ranked together, and the image records the
    // words. set_word_groups() is for an empty ledger; without it every entry is its own word.
    void set_word_groups(bool on);
    bool word_groups() const { return word_groups_; }
    int64_t word(size_t i) const { return word_[i]; }
    int32_t token(size_t i) const { return token_[i]; }

    const int64_t* logical_data() const { return logical_.data(); }
    const int64_t* original_pos_data() const { return original_pos_.data(); }
    float* scores(size_t i) { return scores_.data() + i * n_columns_; }
    const float* scores(size_t i) const { return scores_.data() + i * n_columns_; }

    // First index whose logical index is >= `logical` (entries are sorted by logical index).
    size_t lower_bound(int64_t logical) const;

    // Flat little-endian image, for save_state/load_state and pickling.
    std::vector<uint8_t> serialize() const;
    static Ledger deserialize(const uint8_t* data, size_t size);  // throws std::invalid_argument

private:
    int n_columns_;
    std::vector<int64_t> logical_, original_pos_, cache_pos_, word_;
    std::vector<int32_t> token_;
    std::vector<float> scores_;
    bool word_groups_ = false;
    int n_holders_ = 0;
    std::vector<uint8_t> holders_;  // [entry][head], per-head mode only
};

}  // namespace kvp
