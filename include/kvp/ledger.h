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

    // Appends a token; its score row starts at zero.
    void append(int64_t logical, int64_t original_pos, int64_t cache_pos);
    // Removes the entries whose indices are listed (ascending, unique).
    void remove(const std::vector<size_t>& sorted_indices);
    // Removes every entry from index `first` on.
    void truncate(size_t first);
    void clear() { truncate(0); }

    int64_t logical(size_t i) const { return logical_[i]; }
    int64_t original_pos(size_t i) const { return original_pos_[i]; }
    int64_t cache_pos(size_t i) const { return cache_pos_[i]; }
    void set_cache_pos(size_t i, int64_t pos) { cache_pos_[i] = pos; }
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
    std::vector<int64_t> logical_, original_pos_, cache_pos_;
    std::vector<float> scores_;
};

}  // namespace kvp
