// libFuzzer target for the kvp.bin loader (kvp::parse_policy). Build and run with fuzz/run.sh.
//
// Every input is parsed twice: as given, and with file_bytes and the CRC-32 re-stamped to match it. Without the
// second pass almost every mutation dies at the checksum and the field checks behind it are never reached.
// A file the loader accepts must also be internally consistent (what the scorer relies on without re-checking);
// anything else aborts, which libFuzzer reports as a crash.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kvp/format.h"

namespace {

constexpr size_t kFileBytesOffset = 16;
constexpr size_t kChecksumBytes = 4;

[[noreturn]] void invariant_broken(const char* what) {
    std::fprintf(stderr, "parse_policy accepted an inconsistent policy: %s\n", what);
    std::abort();
}

void expect(bool condition, const char* what) {
    if (!condition) invariant_broken(what);
}

bool all_finite(const std::vector<float>& values) {
    for (float v : values)
        if (!std::isfinite(v)) return false;
    return true;
}

void check_accepted(const kvp::Policy& policy) {
    const kvp::ModelIdentity& id = policy.identity;
    expect(!id.arch.empty() && id.arch.size() < 32, "arch length");
    expect(id.n_layer >= 1 && id.n_layer <= 1024 && id.n_head_kv >= 1 && id.n_head_kv <= 256, "identity ranges");
    expect(policy.pos_features.size() <= kvp::kMaxPosFeatures, "n_pos_features");
    expect(policy.hidden.size() < kvp::kMaxDense, "n_dense");
    expect(policy.layer_scored.size() == id.n_layer, "layer_scored size");
    expect(policy.agents.size() == size_t{id.n_layer} * id.n_head_kv, "agent count");

    const uint32_t input_dim = policy.input_dim();
    bool any_scored = false;
    for (uint32_t layer = 0; layer < id.n_layer; ++layer) {
        any_scored = any_scored || policy.layer_scored[layer];
        for (uint32_t head = 0; head < id.n_head_kv; ++head) {
            const kvp::Agent& agent = policy.agent(layer, head);
            if (!policy.layer_scored[layer]) {
                expect(agent.dense.empty() && agent.shift.empty() && agent.scale.empty(), "unscored layer has weights");
                continue;
            }
            expect(agent.shift.size() == input_dim && agent.scale.size() == input_dim, "shift/scale size");
            expect(all_finite(agent.shift) && all_finite(agent.scale), "non-finite shift/scale");
            expect(agent.dense.size() == policy.hidden.size() + 1, "dense layer count");
            uint32_t n_in = input_dim;
            for (size_t j = 0; j < agent.dense.size(); ++j) {
                const kvp::DenseLayer& dense = agent.dense[j];
                const uint32_t n_out = j < policy.hidden.size() ? policy.hidden[j] : 1;
                expect(dense.n_in == n_in && dense.n_out == n_out, "dense shape chain");
                expect(dense.weight.size() == size_t{n_out} * n_in && dense.bias.size() == n_out, "dense sizes");
                expect(all_finite(dense.weight) && all_finite(dense.bias), "non-finite weight");
                n_in = n_out;
            }
        }
    }
    expect(any_scored, "no scored layer");

    // The position features are evaluated for every cached token; they must not throw for any valid kind.
    std::vector<float> features(policy.pos_features.size());
    for (int64_t position : {int64_t{0}, int64_t{1}, int64_t{8191}, int64_t{1} << 40})
        kvp::compute_pos_features(policy.pos_features, position, features.data());
}

void parse_and_check(const uint8_t* data, size_t size) {
    try {
        check_accepted(kvp::parse_policy(data, size));
    } catch (const kvp::FormatError&) {
        // The expected outcome for almost every input. Any other exception escapes and is reported as a crash.
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    parse_and_check(data, size);
    if (size >= kFileBytesOffset + 8 && size >= kvp::kHeaderBytes + kChecksumBytes) {
        // An exactly sized heap copy, so AddressSanitizer still catches a read one byte past the end.
        std::vector<uint8_t> stamped(data, data + size);
        const uint64_t file_bytes = size;
        for (int i = 0; i < 8; ++i) stamped[kFileBytesOffset + i] = uint8_t(file_bytes >> (8 * i));
        const uint32_t crc = kvp::crc32_ieee(stamped.data(), size - kChecksumBytes);
        for (int i = 0; i < 4; ++i) stamped[size - kChecksumBytes + i] = uint8_t(crc >> (8 * i));
        parse_and_check(stamped.data(), stamped.size());
    }
    return 0;
}
