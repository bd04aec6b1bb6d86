#include "kvp/ledger.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace kvp {

void Ledger::append(int64_t logical, int64_t original_pos, int64_t cache_pos, int64_t word, int32_t token) {
    logical_.push_back(logical);
    original_pos_.push_back(original_pos);
    cache_pos_.push_back(cache_pos);
    word_.push_back(word < 0 ? logical : word);
    token_.push_back(token);
    scores_.resize(scores_.size() + n_columns_, 0.0f);
    holders_.resize(holders_.size() + size_t(n_holders_), 1);
}

void Ledger::set_holders(int n_holders) {
    if (!empty()) throw std::logic_error("set_holders on a ledger that holds tokens");
    if (n_holders < 0) throw std::invalid_argument("negative holder count");
    n_holders_ = n_holders;
    holders_.clear();
}

void Ledger::set_word_groups(bool on) {
    if (!empty()) throw std::logic_error("set_word_groups on a ledger that holds tokens");
    word_groups_ = on;
}

bool Ledger::held_by_any(size_t i) const {
    if (n_holders_ == 0) return true;
    const uint8_t* row = holders_.data() + i * n_holders_;
    return std::any_of(row, row + n_holders_, [](uint8_t h) { return h != 0; });
}

size_t Ledger::held_count(int head, size_t first, size_t last) const {
    last = std::min(last, size());
    if (first >= last) return 0;
    if (n_holders_ == 0) return last - first;
    size_t n = 0;
    for (size_t i = first; i < last; ++i) n += holders_[i * n_holders_ + head] != 0;
    return n;
}

void Ledger::remove(const std::vector<size_t>& sorted_indices) {
    if (sorted_indices.empty()) return;
    size_t write = 0, next_removed = 0;
    for (size_t read = 0; read < size(); ++read) {
        if (next_removed < sorted_indices.size() && sorted_indices[next_removed] == read) {
            ++next_removed;
            continue;
        }
        if (write != read) {
            logical_[write] = logical_[read];
            original_pos_[write] = original_pos_[read];
            cache_pos_[write] = cache_pos_[read];
            word_[write] = word_[read];
            token_[write] = token_[read];
            std::memmove(scores(write), scores(read), n_columns_ * sizeof(float));
            if (n_holders_)
                std::memmove(holders_.data() + write * n_holders_, holders_.data() + read * n_holders_, size_t(n_holders_));
        }
        ++write;
    }
    truncate(write);
}

void Ledger::truncate(size_t first) {
    first = std::min(first, size());
    logical_.resize(first);
    original_pos_.resize(first);
    cache_pos_.resize(first);
    word_.resize(first);
    token_.resize(first);
    scores_.resize(first * n_columns_);
    holders_.resize(first * size_t(n_holders_));
}

size_t Ledger::lower_bound(int64_t logical) const {
    return size_t(std::lower_bound(logical_.begin(), logical_.end(), logical) - logical_.begin());
}

namespace {
constexpr char kLedgerMagic[8] = {'K', 'V', 'P', 'L', 'E', 'D', 'G', '1'};
// per-head mode: a third header field, n_holders, and after the scores one byte per (entry, head)
constexpr char kPerHeadLedgerMagic[8] = {'K', 'V', 'P', 'L', 'E', 'D', 'G', '2'};
// word groups (either mode): the three header fields, and after the cache positions each entry's word (int64) and
// token id (int32)
constexpr char kWordLedgerMagic[8] = {'K', 'V', 'P', 'L', 'E', 'D', 'G', '3'};

template <typename T>
void put(std::vector<uint8_t>& out, const T* values, size_t count) {
    const auto* bytes = reinterpret_cast<const uint8_t*>(values);
    out.insert(out.end(), bytes, bytes + count * sizeof(T));
}
}  // namespace

std::vector<uint8_t> Ledger::serialize() const {
    std::vector<uint8_t> out;
    put(out, word_groups_ ? kWordLedgerMagic : n_holders_ ? kPerHeadLedgerMagic : kLedgerMagic, 8);
    const uint64_t header[3] = {uint64_t(n_columns_), uint64_t(size()), uint64_t(n_holders_)};
    put(out, header, n_holders_ || word_groups_ ? 3 : 2);
    put(out, logical_.data(), size());
    put(out, original_pos_.data(), size());
    put(out, cache_pos_.data(), size());
    if (word_groups_) {
        put(out, word_.data(), size());
        put(out, token_.data(), size());
    }
    put(out, scores_.data(), scores_.size());
    put(out, holders_.data(), holders_.size());
    return out;
}

Ledger Ledger::deserialize(const uint8_t* data, size_t size) {
    const bool words = size >= 8 && std::memcmp(data, kWordLedgerMagic, 8) == 0;
    const bool per_head = size >= 8 && std::memcmp(data, kPerHeadLedgerMagic, 8) == 0;
    const size_t header_bytes = per_head || words ? 32 : 24;
    if (size < header_bytes || (!per_head && !words && std::memcmp(data, kLedgerMagic, 8) != 0))
        throw std::invalid_argument("not a kvp ledger image");
    uint64_t header[3] = {0, 0, 0};
    std::memcpy(header, data + 8, header_bytes - 8);
    const uint64_t n_columns = header[0], n = header[1], n_holders = header[2];
    if (n_columns == 0 || n_columns > (1u << 20) || n > (uint64_t(1) << 32) || (per_head && n_holders == 0) ||
        n_holders > (1u << 16) ||
        size != header_bytes + n * (3 * sizeof(int64_t) + n_columns * sizeof(float) + n_holders +
                                    (words ? sizeof(int64_t) + sizeof(int32_t) : 0)))
        throw std::invalid_argument("kvp ledger image has inconsistent sizes");
    Ledger ledger{int(n_columns)};
    ledger.n_holders_ = int(n_holders);
    ledger.word_groups_ = words;
    if (n == 0) return ledger;  // memcpy into an empty vector's null data() is undefined, even for 0 bytes
    ledger.logical_.resize(n);
    ledger.original_pos_.resize(n);
    ledger.cache_pos_.resize(n);
    ledger.scores_.resize(n * n_columns);
    const uint8_t* p = data + header_bytes;
    for (auto* v : {&ledger.logical_, &ledger.original_pos_, &ledger.cache_pos_}) {
        std::memcpy(v->data(), p, n * sizeof(int64_t));
        p += n * sizeof(int64_t);
    }
    if (words) {
        ledger.word_.resize(n);
        ledger.token_.resize(n);
        std::memcpy(ledger.word_.data(), p, n * sizeof(int64_t));
        p += n * sizeof(int64_t);
        std::memcpy(ledger.token_.data(), p, n * sizeof(int32_t));
        p += n * sizeof(int32_t);
        for (size_t i = 0; i < n; ++i)
            if (ledger.word_[i] < 0 || ledger.word_[i] > ledger.logical_[i])
                throw std::invalid_argument("kvp ledger image has a word that starts after its token");
    } else {
        ledger.word_ = ledger.logical_;
        ledger.token_.assign(n, -1);
    }
    std::memcpy(ledger.scores_.data(), p, n * n_columns * sizeof(float));
    p += n * n_columns * sizeof(float);
    ledger.holders_.assign(p, p + n * n_holders);
    for (size_t i = 0; i < n; ++i)
        if (n_holders && !ledger.held_by_any(i)) throw std::invalid_argument("kvp ledger image has an entry no head holds");
    return ledger;
}

}  // namespace kvp
