// FNV-1a (64 bit) as 16 hex digits: the short fingerprints that results logs carry.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

namespace kvp::bench {

class Fnv1a {
public:
    void add_bytes(const uint8_t* data, size_t size) {
        for (size_t i = 0; i < size; ++i) add_byte(data[i]);
    }
    // little-endian on every host, so a digest means the same everywhere
    void add_int64(int64_t value) {
        for (int byte = 0; byte < 8; ++byte) add_byte(uint8_t(uint64_t(value) >> (8 * byte)));
    }
    std::string hex() const {
        char text[17];
        std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(hash_));
        return text;
    }

private:
    void add_byte(uint8_t byte) {
        hash_ ^= byte;
        hash_ *= 0x100000001b3ull;
    }
    uint64_t hash_ = 0xcbf29ce484222325ull;
};

}  // namespace kvp::bench
