// C++ core tests, built and run under AddressSanitizer + UndefinedBehaviorSanitizer by ci/sanitizers.sh:
//
//     test_core POLICY.kvp.bin...    (files written by the Python writer, kvp_cpp.policy_file)
//
// For every file: the loaded Policy, encoded again by the minimal writer below, is byte-identical to the file, and
// every kernel set's scores match a double-precision re-computation written out here from the spec. Then the
// evictor on hand-made ledgers (non-finite scores included), and the ledger's image round trip and its rejection of
// corrupt images.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kvp/evictor.h"
#include "kvp/format.h"
#include "kvp/kernels.h"
#include "kvp/ledger.h"
#include "kvp/policy.h"
#include "kvp/scorer.h"

namespace {

int g_checks = 0;
int g_failures = 0;

#define CHECK(condition)                                                                   \
    do {                                                                                   \
        ++g_checks;                                                                        \
        if (!(condition)) {                                                                \
            ++g_failures;                                                                  \
            std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #condition); \
        }                                                                                  \
    } while (0)

template <typename Exception, typename Fn>
bool throws(Fn&& fn) {
    try {
        fn();
    } catch (const Exception&) {
        return true;
    }
    return false;
}

// Whether Ledger::deserialize refuses the bytes with std::invalid_argument.
bool ledger_image_rejected(const std::vector<uint8_t>& bytes) {
    return throws<std::invalid_argument>([&] { kvp::Ledger::deserialize(bytes.data(), bytes.size()); });
}

// Whether every cut of the image at 0, step, 2 x step ... bytes is refused.
bool truncations_rejected(const std::vector<uint8_t>& image, size_t step) {
    for (size_t size = 0; size < image.size(); size += step)
        if (!ledger_image_rejected(std::vector<uint8_t>(image.begin(), image.begin() + ptrdiff_t(size)))) return false;
    return true;
}

std::vector<uint8_t> read_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error("cannot open " + path);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// --- format: encode a parsed Policy again ------------------------------------------------------------------------

class ByteWriter {
public:
    void u32(uint32_t v) { little_endian(v, 4); }
    void u64(uint64_t v) { little_endian(v, 8); }
    void f32(float v) { u32(std::bit_cast<uint32_t>(v)); }
    void f16(float v) { little_endian(half_bits(v), 2); }
    void raw(const void* data, size_t n) {
        const auto* p = static_cast<const uint8_t*>(data);
        bytes.insert(bytes.end(), p, p + n);
    }
    std::vector<uint8_t> bytes;

private:
    void little_endian(uint64_t v, int n) {
        for (int i = 0; i < n; ++i) bytes.push_back(uint8_t(v >> (8 * i)));
    }
    // The loader widened every f16 exactly, so narrowing back must be exact too; anything else is a failed check.
    static uint16_t half_bits(float value) {
        const uint32_t bits = std::bit_cast<uint32_t>(value);
        const uint16_t sign = uint16_t((bits >> 16) & 0x8000u);
        const float magnitude = std::fabs(value);
        if (magnitude == 0.0f) return sign;
        if (magnitude < 0x1p-14f) {  // subnormal: mantissa * 2^-24
            const float mantissa = magnitude * 0x1p24f;
            CHECK(mantissa == std::floor(mantissa));
            return uint16_t(sign | uint16_t(mantissa));
        }
        const int exponent = int((bits >> 23) & 0xffu) - 127 + 15;
        CHECK(exponent >= 1 && exponent <= 30 && (bits & 0x1fffu) == 0);
        return uint16_t(sign | (exponent << 10) | ((bits >> 13) & 0x3ffu));
    }
};

std::vector<uint8_t> encode(const kvp::Policy& policy) {
    const kvp::ModelIdentity& id = policy.identity;
    ByteWriter w;
    w.raw(kvp::kPolicyMagic, sizeof kvp::kPolicyMagic);
    w.u32(policy.n_recency_knots ? 2 : 1);
    w.u32(kvp::kHeaderBytes);
    w.u64(0);  // file_bytes, stamped below
    char arch[32] = {};
    std::memcpy(arch, id.arch.data(), std::min(id.arch.size(), sizeof arch - 1));
    w.raw(arch, sizeof arch);
    for (uint32_t v : {id.n_layer, id.n_head_kv, id.head_dim_k, id.head_dim_v, id.n_ctx_train}) w.u32(v);
    w.u32(uint32_t(policy.pos_features.size()));
    w.u32(uint32_t(policy.hidden.size() + 1));
    for (size_t j = 0; j < kvp::kMaxDense - 1; ++j) w.u32(j < policy.hidden.size() ? policy.hidden[j] : 0);
    w.u32(uint32_t(policy.activation));
    w.u32(uint32_t(policy.weight_dtype));
    w.u32(policy.n_sink);
    w.u32(policy.n_recent);
    w.u64(policy.metadata_json.size());
    w.u32(policy.n_recency_knots);
    w.u32(0);  // reserved
    for (const kvp::PosFeature& feature : policy.pos_features) {
        w.u32(uint32_t(feature.kind));
        w.f32(feature.a);
    }
    for (bool scored : policy.layer_scored) w.u32(scored ? 1 : 0);
    const bool f16 = policy.weight_dtype == kvp::WeightDtype::f16;
    for (uint32_t layer = 0; layer < id.n_layer; ++layer) {
        if (!policy.layer_scored[layer]) continue;
        for (uint32_t head = 0; head < id.n_head_kv; ++head) {
            const kvp::Agent& agent = policy.agent(layer, head);
            for (float v : agent.shift) w.f32(v);
            for (float v : agent.scale) w.f32(v);
            for (const kvp::DenseLayer& dense : agent.dense) {
                for (const std::vector<float>* values : {&dense.weight, &dense.bias})
                    for (float v : *values) f16 ? w.f16(v) : w.f32(v);
            }
        }
    }
    for (uint32_t layer = 0; layer < id.n_layer; ++layer)
        for (uint32_t head = 0; head < id.n_head_kv && policy.layer_scored[layer]; ++head)
            for (float v : policy.agent(layer, head).recency) w.f32(v);
    w.raw(policy.metadata_json.data(), policy.metadata_json.size());
    const uint64_t file_bytes = w.bytes.size() + 4;
    for (int i = 0; i < 8; ++i) w.bytes[16 + i] = uint8_t(file_bytes >> (8 * i));
    w.u32(kvp::crc32_ieee(w.bytes.data(), w.bytes.size()));
    return w.bytes;
}

void test_format_round_trip(const std::string& path, const std::vector<uint8_t>& file, const kvp::Policy& policy) {
    CHECK(encode(policy) == file);
    const kvp::Policy parsed = kvp::parse_policy(file.data(), file.size());
    CHECK(parsed.identity == policy.identity && parsed.metadata_json == policy.metadata_json);
    // Every strict prefix is refused cleanly (the exactly sized copy lets ASan see any read past its end).
    for (size_t size = 0; size < file.size(); size += 1 + size / 16) {
        const std::vector<uint8_t> prefix(file.begin(), file.begin() + ptrdiff_t(size));
        CHECK(throws<kvp::FormatError>([&] { kvp::parse_policy(prefix.data(), prefix.size()); }));
    }
    std::printf("  format round trip: %s (%zu bytes, %s)\n", path.c_str(), file.size(),
                policy.weight_dtype == kvp::WeightDtype::f16 ? "f16" : "f32");
}

// --- scorer against a scalar re-computation ----------------------------------------------------------------------

double activate(kvp::Activation act, double x) {
    switch (act) {
        case kvp::Activation::relu: return x > 0 ? x : 0.0;
        case kvp::Activation::silu: return x / (1.0 + std::exp(-x));
        case kvp::Activation::gelu_tanh:
            return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
        case kvp::Activation::tanh: return std::tanh(x);
    }
    throw std::logic_error("unknown activation");
}

// docs/kvp-bin-format.md: position features in double, rounded to f32.
float position_feature(const kvp::PosFeature& feature, int64_t position) {
    const double p = double(position), a = feature.a;
    switch (feature.kind) {
        case kvp::PosFeatureKind::linear: return float(p / a);
        case kvp::PosFeatureKind::log: return float(std::log1p(p) / a);
        case kvp::PosFeatureKind::sine: return float(std::sin(p * a));
        case kvp::PosFeatureKind::cosine: return float(std::cos(p * a));
    }
    throw std::logic_error("unknown position feature");
}

double reference_score(const kvp::Policy& policy, const kvp::Agent& agent, const float* k, const float* v,
                       int64_t position) {
    const uint32_t dk = policy.identity.head_dim_k, dv = policy.identity.head_dim_v;
    std::vector<double> x;
    for (uint32_t d = 0; d < dk; ++d) x.push_back(k[d]);
    for (uint32_t d = 0; d < dv; ++d) x.push_back(v[d]);
    for (const kvp::PosFeature& feature : policy.pos_features) x.push_back(position_feature(feature, position));
    for (size_t d = 0; d < x.size(); ++d) x[d] = (x[d] - agent.shift[d]) * agent.scale[d];
    for (size_t j = 0; j < agent.dense.size(); ++j) {
        const kvp::DenseLayer& dense = agent.dense[j];
        std::vector<double> y(dense.n_out);
        for (uint32_t o = 0; o < dense.n_out; ++o) {
            double sum = dense.bias[o];
            for (uint32_t i = 0; i < dense.n_in; ++i) sum += double(dense.weight[size_t(o) * dense.n_in + i]) * x[i];
            y[o] = j + 1 < agent.dense.size() ? activate(policy.activation, sum) : sum;
        }
        x = std::move(y);
    }
    return x.at(0);
}

// K or V laid out like a ggml view with padding between heads and between tokens, in a buffer of exactly the size
// the strides imply, so a kernel reading past a row or past the tensor trips AddressSanitizer.
struct PaddedTensor {
    PaddedTensor(int64_t n_token, int64_t n_head, int64_t dim, std::mt19937& rng)
        : head_floats(dim + 3), token_floats(n_head * (dim + 3) + 5),
          data(size_t((n_token - 1) * token_floats + (n_head - 1) * head_floats + dim)) {
        std::uniform_real_distribution<float> uniform(-2.0f, 2.0f);
        for (float& x : data) x = uniform(rng);
        view = {data.data(), dim, n_head, n_token, size_t(head_floats) * sizeof(float),
                size_t(token_floats) * sizeof(float)};
    }
    int64_t head_floats, token_floats;
    std::vector<float> data;
    kvp::HeadTokenView view;
};

void test_scorer(const std::shared_ptr<const kvp::Policy>& policy, uint32_t seed) {
    const kvp::ModelIdentity& id = policy->identity;
    // Two full token blocks and a partial one: the parallel path, with a ragged last block.
    const int64_t n_token = 2 * kvp::Scorer::kTokenBlock + 13;
    std::mt19937 rng(seed);
    PaddedTensor k(n_token, id.n_head_kv, id.head_dim_k, rng), v(n_token, id.n_head_kv, id.head_dim_v, rng);
    std::vector<int64_t> positions(static_cast<size_t>(n_token));
    std::uniform_int_distribution<int64_t> position(0, 1'000'000);
    for (int64_t& p : positions) p = position(rng);
    positions[0] = 0;

    for (const kvp::KernelSet* kernels : kvp::available_kernels()) {
        const kvp::Scorer scorer(policy, *kernels, 2);
        double worst = 0.0;
        for (uint32_t layer = 0; layer < id.n_layer; ++layer) {
            if (!scorer.layer_scored(int(layer))) {
                std::vector<float> unused(size_t(n_token) * id.n_head_kv);
                CHECK(throws<std::invalid_argument>(
                    [&] { scorer.score_layer(int(layer), k.view, v.view, positions.data(), unused.data()); }));
                continue;
            }
            std::vector<float> scores(size_t(n_token) * id.n_head_kv);
            scorer.score_layer(int(layer), k.view, v.view, positions.data(), scores.data());
            std::vector<double> reference(scores.size());
            double largest = 1.0;
            for (int64_t t = 0; t < n_token; ++t)
                for (uint32_t h = 0; h < id.n_head_kv; ++h) {
                    double& r = reference[size_t(t) * id.n_head_kv + h];
                    r = reference_score(*policy, policy->agent(layer, h), k.view.row(t, h), v.view.row(t, h),
                                        positions[size_t(t)]);
                    largest = std::max(largest, std::fabs(r));
                }
            for (size_t i = 0; i < scores.size(); ++i) {
                const double error = std::fabs(double(scores[i]) - reference[i]);
                worst = std::max(worst, error / largest);
                CHECK(error <= 2e-5 * largest);
            }
        }
        std::printf("  scorer %-6s: worst error %.2e of the largest score\n", kernels->name, worst);
    }
    const kvp::KernelSet& scalar = kvp::kernels_by_name("scalar");
    const kvp::Scorer scorer(policy, scalar, 1);
    std::vector<float> out(size_t(n_token) * id.n_head_kv);
    kvp::HeadTokenView wrong_dim = k.view;
    wrong_dim.dim += 1;
    CHECK(throws<std::invalid_argument>(
        [&] { scorer.score_layer(0, wrong_dim, v.view, positions.data(), out.data()); }));
    CHECK(throws<std::invalid_argument>(
        [&] { scorer.score_layer(int(id.n_layer), k.view, v.view, positions.data(), out.data()); }));
}

// The learned policy's recency terms against the spec's formula, written out again: for every scored (layer, head)
// column of a ledger of tokens at scattered positions, score + h(next_position - position).
void test_recency_terms(const std::shared_ptr<const kvp::Policy>& policy) {
    const kvp::ModelIdentity& id = policy->identity;
    const auto learned = kvp::make_learned_policy(policy, kvp::PolicyOptions{});
    CHECK(learned->has_recency_terms() == (policy->n_recency_knots > 0));
    if (!learned->has_recency_terms()) return;
    const std::vector<int64_t> positions = {0, 1, 2, 3, 6, 100, 1000, 5000, 9998};
    const int64_t next_position = 9999;
    kvp::Ledger ledger(learned->n_score_columns());
    for (size_t i = 0; i < positions.size(); ++i) {
        ledger.append(positions[i], positions[i], int64_t(i));
        for (int c = 0; c < ledger.n_columns(); ++c) ledger.scores(i)[c] = float(0.25 * double(c) - double(i));
    }
    kvp::Ledger ranking = ledger;
    learned->add_recency_terms(ranking, next_position);
    const double last = double(policy->n_recency_knots - 1);
    for (size_t i = 0; i < positions.size(); ++i) {
        const double u = std::min(std::log2(double(next_position - positions[i])), last);
        int column = 0;
        for (uint32_t layer = 0; layer < id.n_layer; ++layer) {
            if (!policy->layer_scored[layer]) continue;
            for (uint32_t h = 0; h < id.n_head_kv; ++h, ++column) {
                const std::vector<float>& knots = policy->agent(layer, h).recency;
                double term = knots[0];
                if (knots.size() > 1) {
                    const size_t j = std::min(size_t(std::floor(u)), knots.size() - 2);
                    term = knots[j] + (u - double(j)) * (double(knots[j + 1]) - knots[j]);
                }
                const double expected = double(ledger.scores(i)[column]) + term;
                CHECK(std::fabs(ranking.scores(i)[column] - expected) <= 1e-6 * std::max(1.0, std::fabs(expected)));
            }
        }
    }
}

// --- evictor on hand-made ledgers --------------------------------------------------------------------------------

kvp::Ledger make_ledger(const std::vector<int64_t>& logical, const std::vector<std::vector<float>>& scores) {
    kvp::Ledger ledger(int(scores.front().size()));
    for (size_t i = 0; i < logical.size(); ++i) {
        ledger.append(logical[i], logical[i], int64_t(i));
        std::copy(scores[i].begin(), scores[i].end(), ledger.scores(i));
    }
    return ledger;
}

void test_evictor() {
    // Ten tokens, logical 0, 1 sinks and 7, 8, 9 recent under {n_sink 2, n_recent 3}: candidates are indices 2..6.
    const std::vector<int64_t> logical{0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
    const kvp::Protection protection{2, 3};
    //                       sink        sink        cand 2      cand 3       cand 4      cand 5      cand 6
    const kvp::Ledger one_column = make_ledger(
        logical, {{-9}, {-9}, {3}, {1}, {5}, {1}, {0.5f}, {-9}, {-9}, {-9}});
    CHECK(kvp::eviction_candidates(one_column, protection) == (std::vector<size_t>{2, 3, 4, 5, 6}));
    using V = std::vector<size_t>;
    for (kvp::HeadCombine combine :
         {kvp::HeadCombine::sum_softmax, kvp::HeadCombine::max_softmax, kvp::HeadCombine::mean,
          kvp::HeadCombine::mean_rank}) {
        // With one column every combination ranks like the raw score: 0.5 < 1 = 1 < 3 < 5; the tie goes to the older.
        CHECK(kvp::select_victims(one_column, protection, 1, combine) == V{6});
        CHECK(kvp::select_victims(one_column, protection, 2, combine) == (V{3, 6}));
        CHECK(kvp::select_victims(one_column, protection, 3, combine) == (V{3, 5, 6}));
        CHECK(kvp::select_victims(one_column, protection, 0, combine).empty());
        CHECK(kvp::select_victims(one_column, protection, 5, combine) == (V{2, 3, 4, 5, 6}));
        CHECK(throws<std::logic_error>([&] { kvp::select_victims(one_column, protection, 6, combine); }));
    }

    // Two columns on different scales:
    //   candidate      2          3          4          5          6
    //   column 0     100        0          50         0          0
    //   column 1       0        3          2          1          0
    const kvp::Ledger two_columns = make_ledger(
        logical, {{0, 0}, {0, 0}, {100, 0}, {0, 3}, {50, 2}, {0, 1}, {0, 0}, {0, 0}, {0, 0}, {0, 0}});
    // mean: 50, 1.5, 26, 0.5, 0: follows the large column 0
    CHECK(kvp::select_victims(two_columns, protection, 3, kvp::HeadCombine::mean) == (V{3, 5, 6}));
    // softmax per column: column 0 gives candidate 2 almost 1 and the rest almost 0; column 1 gives 0.031, 0.624,
    // 0.230, 0.084, 0.031. Summed or maxed, 3 now outranks 4.
    CHECK(kvp::select_victims(two_columns, protection, 3, kvp::HeadCombine::sum_softmax) == (V{4, 5, 6}));
    CHECK(kvp::select_victims(two_columns, protection, 3, kvp::HeadCombine::max_softmax) == (V{4, 5, 6}));
    // mean rank, ties ranked in candidate order: column 0 ranks 4 0 3 1 2, column 1 ranks 0 4 3 2 1, means
    // 2 2 3 1.5 1.5: 5 and 6 tie (5, older, goes first), then 2 and 3 tie (2 goes, despite its 100).
    CHECK(kvp::select_victims(two_columns, protection, 1, kvp::HeadCombine::mean_rank) == V{5});
    CHECK(kvp::select_victims(two_columns, protection, 3, kvp::HeadCombine::mean_rank) == (V{2, 5, 6}));
    const std::vector<double> keep =
        kvp::combined_keep_scores(two_columns, {2, 3, 4, 5, 6}, kvp::HeadCombine::sum_softmax);
    double total = 0.0;
    for (double x : keep) total += x;
    CHECK(std::fabs(total - 2.0) < 1e-12);  // each column's softmax sums to one

    // Non-finite scores (a hostile or overflowing policy) are the lowest keep-score, whatever the combination: they
    // leave first, oldest first, and the finite candidates are ranked as if they were absent. The NaN on sink 1 and
    // the inf on recent 8 are protected all the same.
    const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
    const kvp::Ledger non_finite = make_ledger(
        logical, {{-9}, {nan}, {3}, {nan}, {5}, {inf}, {0.5f}, {-9}, {inf}, {-9}});
    const kvp::Ledger all_non_finite = make_ledger(
        logical, {{-9}, {-9}, {-inf}, {nan}, {inf}, {nan}, {-inf}, {-9}, {-9}, {-9}});
    //                             cand 2      cand 3 (NaN)   cand 4     cand 5      cand 6
    const kvp::Ledger nan_in_one_column = make_ledger(
        logical, {{0, 0}, {0, 0}, {100, 0}, {0, nan}, {50, 2}, {0, 1}, {0, 0}, {0, 0}, {0, 0}, {0, 0}});
    for (kvp::HeadCombine combine :
         {kvp::HeadCombine::sum_softmax, kvp::HeadCombine::max_softmax, kvp::HeadCombine::mean,
          kvp::HeadCombine::mean_rank}) {
        CHECK(kvp::select_victims(non_finite, protection, 1, combine) == V{3});  // NaN and inf tie: the older goes
        CHECK(kvp::select_victims(non_finite, protection, 2, combine) == (V{3, 5}));
        CHECK(kvp::select_victims(non_finite, protection, 3, combine) == (V{3, 5, 6}));
        CHECK(kvp::select_victims(non_finite, protection, 4, combine) == (V{2, 3, 5, 6}));
        CHECK(kvp::select_victims(all_non_finite, protection, 2, combine) == (V{2, 3}));
        CHECK(kvp::select_victims(all_non_finite, protection, 5, combine) == (V{2, 3, 4, 5, 6}));
        const std::vector<double> keep = kvp::combined_keep_scores(nan_in_one_column, {2, 3, 4, 5, 6}, combine);
        const std::vector<double> without = kvp::combined_keep_scores(two_columns, {2, 4, 5, 6}, combine);
        CHECK(keep[1] == -INFINITY);
        CHECK(keep[0] == without[0] && keep[2] == without[1] && keep[3] == without[2] && keep[4] == without[3]);
        CHECK(kvp::select_victims(nan_in_one_column, protection, 1, combine) == V{3});
    }

    // After an eviction the logical indices have gaps: the sinks are found by logical index, not by position.
    kvp::Ledger gapped = make_ledger(logical, {{0}, {0}, {0}, {0}, {0}, {0}, {0}, {0}, {0}, {0}});
    gapped.remove({0, 3, 4});
    CHECK(gapped.size() == 7 && gapped.logical(0) == 1 && gapped.logical(2) == 5);
    CHECK(kvp::eviction_candidates(gapped, protection) == (V{1, 2, 3}));  // logical 1 is still a sink
    CHECK(kvp::eviction_candidates(gapped, {0, 7}).empty());
    CHECK(kvp::eviction_candidates(kvp::Ledger(1), protection).empty());
    std::printf("  evictor: hand-made ledgers\n");
}

kvp::Ledger make_per_head_ledger(const std::vector<int64_t>& logical, const std::vector<std::vector<float>>& scores,
                                 int n_heads) {
    kvp::Ledger ledger(int(scores.front().size()));
    ledger.set_holders(n_heads);
    for (size_t i = 0; i < logical.size(); ++i) {
        ledger.append(logical[i], logical[i], int64_t(i));
        std::copy(scores[i].begin(), scores[i].end(), ledger.scores(i));
    }
    return ledger;
}

// Double-precision reference of select_victims_per_head, written from its contract: head h ranks the candidates it
// holds by (1 - w) x n_heads x softmax(own column over them) + w x sum over heads of softmax(column over all
// candidates); the lowest go, ties to the older.
// `columns` maps head h to its score column (empty: column h); the vote sums over the heads' columns, each once.
std::vector<size_t> reference_head_victims(const kvp::Ledger& ledger, const std::vector<size_t>& candidates, int h,
                                           size_t n_evict, double w, std::vector<int> columns = {}) {
    const int n_heads = ledger.n_holders();
    if (columns.empty())
        for (int c = 0; c < n_heads; ++c) columns.push_back(c);
    const int own_column = columns[size_t(h)];
    std::sort(columns.begin(), columns.end());
    columns.erase(std::unique(columns.begin(), columns.end()), columns.end());
    std::vector<double> vote(candidates.size(), 0.0);
    for (int c : columns) {
        double total = 0.0;
        for (size_t i : candidates) total += std::exp(double(ledger.scores(i)[c]));
        for (size_t j = 0; j < candidates.size(); ++j) vote[j] += std::exp(double(ledger.scores(candidates[j])[c])) / total;
    }
    std::vector<size_t> mine;
    std::vector<double> vote_of_mine;
    double own_total = 0.0;
    for (size_t j = 0; j < candidates.size(); ++j)
        if (ledger.held(candidates[j], h)) {
            mine.push_back(candidates[j]);
            vote_of_mine.push_back(vote[j]);
            own_total += std::exp(double(ledger.scores(candidates[j])[own_column]));
        }
    std::vector<std::pair<double, size_t>> keyed;
    for (size_t j = 0; j < mine.size(); ++j) {
        const double own = std::exp(double(ledger.scores(mine[j])[own_column])) / own_total;
        keyed.push_back({(1.0 - w) * n_heads * own + w * vote_of_mine[j], mine[j]});
    }
    std::sort(keyed.begin(), keyed.end());
    std::vector<size_t> victims;
    for (size_t r = 0; r < n_evict; ++r) victims.push_back(keyed[r].second);
    std::sort(victims.begin(), victims.end());
    return victims;
}

void test_evictor_per_head() {
    using V = std::vector<size_t>;
    const std::vector<int64_t> logical{0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
    const kvp::Protection protection{2, 3};  // candidates: indices 2..6
    // Three heads; heads 1 and 2 want candidate 6, which head 0 ranks last.
    //   candidate   2   3   4   5   6
    //   head 0      5   4   3   2   0
    //   heads 1, 2  0   1   2   3   9
    std::vector<std::vector<float>> rows(10, std::vector<float>{0, 0, 0});
    const float head0[] = {5, 4, 3, 2, 0}, others[] = {0, 1, 2, 3, 9};
    for (size_t j = 0; j < 5; ++j) rows[j + 2] = {head0[j], others[j], others[j]};
    const kvp::Ledger per_head = make_per_head_ledger(logical, rows, 3);
    const kvp::Ledger shared = make_ledger(logical, rows);
    // Consensus 0: every head by its own column.
    CHECK(kvp::select_victims_per_head(per_head, protection, 1) == (std::vector<V>{V{6}, V{2}, V{2}}));
    CHECK(kvp::select_victims_per_head(per_head, protection, 2, 0.0) == (std::vector<V>{V{5, 6}, V{2, 3}, V{2, 3}}));
    // Consensus 1 from a common start: every head evicts exactly what shared mode's sum_softmax evicts.
    for (size_t n = 1; n <= 5; ++n) {
        const V expected = kvp::select_victims(shared, protection, n, kvp::HeadCombine::sum_softmax);
        CHECK(kvp::select_victims_per_head(per_head, protection, n, 1.0) == (std::vector<V>(3, expected)));
    }
    CHECK(kvp::select_victims(shared, protection, 1, kvp::HeadCombine::sum_softmax) == V{5});
    // Half way: head 0 now keeps the token the other heads want and gives up its second-lowest instead.
    CHECK(kvp::select_victims_per_head(per_head, protection, 1, 0.5)[0] == V{5});
    // A one-column policy scores every head alike: the consensus changes nothing.
    const kvp::Ledger one_column = make_per_head_ledger(logical, {{-9}, {-9}, {3}, {1}, {5}, {1}, {0.5f}, {-9}, {-9}, {-9}}, 2);
    for (double w : {0.0, 0.5, 1.0})
        CHECK(kvp::select_victims_per_head(one_column, protection, 2, w) == (std::vector<V>{V{3, 6}, V{3, 6}}));
    for (double w : {-0.1, 1.5, std::nan("")})
        CHECK(throws<std::invalid_argument>([&] { kvp::select_victims_per_head(per_head, protection, 1, w); }));

    // Random scores, heads that already hold different tokens, several weights: against the float64 reference.
    std::mt19937 rng(5);
    std::normal_distribution<float> normal(0.0f, 2.0f);
    constexpr int n_heads = 4, n_tokens = 40;
    std::vector<int64_t> positions(n_tokens);
    std::vector<std::vector<float>> random_rows(n_tokens, std::vector<float>(n_heads));
    for (int i = 0; i < n_tokens; ++i) {
        positions[size_t(i)] = i;
        for (float& x : random_rows[size_t(i)]) x = normal(rng);
    }
    kvp::Ledger mixed = make_per_head_ledger(positions, random_rows, n_heads);
    for (int h = 0; h < n_heads; ++h)
        for (int i = 5 + h; i < n_tokens - 5; i += 3 + h) mixed.release(size_t(i), h);
    const std::vector<size_t> candidates = kvp::eviction_candidates(mixed, protection);
    bool all_match = true, some_differ = false;
    for (double w : {0.0, 0.1, 0.3, 0.5, 0.8, 1.0}) {
        const auto victims = kvp::select_victims_per_head(mixed, protection, 6, w);
        for (int h = 0; h < n_heads; ++h) {
            all_match &= victims[size_t(h)] == reference_head_victims(mixed, candidates, h, 6, w);
            some_differ |= victims[size_t(h)] != reference_head_victims(mixed, candidates, h, 6, 0.0);
        }
    }
    CHECK(all_match);
    CHECK(some_differ);  // the weight matters on this ledger, so the comparison is not vacuous

    // Head columns: a policy scoring more heads than the cache evicts per head (Gemma 3 scores 18 layers, the
    // per-head cache holds 3). Ten columns, four heads on columns 7, 2, 9, 4: the reference, and the same
    // ranking as a four-column ledger holding just those columns, which the vote must not see past.
    const std::vector<int> head_columns{7, 2, 9, 4};
    std::vector<std::vector<float>> wide_rows(n_tokens, std::vector<float>(10)), narrow_rows(n_tokens);
    for (int i = 0; i < n_tokens; ++i) {
        for (float& x : wide_rows[size_t(i)]) x = normal(rng);
        for (int c : head_columns) narrow_rows[size_t(i)].push_back(wide_rows[size_t(i)][size_t(c)]);
    }
    kvp::Ledger wide = make_per_head_ledger(positions, wide_rows, n_heads);
    kvp::Ledger narrow = make_per_head_ledger(positions, narrow_rows, n_heads);
    for (int h = 0; h < n_heads; ++h)
        for (int i = 6 + h; i < n_tokens - 5; i += 2 + h) wide.release(size_t(i), h), narrow.release(size_t(i), h);
    bool mapped_match = true, same_as_narrow = true, unmapped_differ = false;
    for (double w : {0.0, 0.4, 0.9, 1.0}) {
        const auto victims = kvp::select_victims_per_head(wide, protection, 5, w, head_columns);
        same_as_narrow &= victims == kvp::select_victims_per_head(narrow, protection, 5, w);
        for (int h = 0; h < n_heads; ++h) {
            mapped_match &= victims[size_t(h)] == reference_head_victims(wide, candidates, h, 5, w, head_columns);
            unmapped_differ |= victims[size_t(h)] != reference_head_victims(wide, candidates, h, 5, w, {0, 1, 2, 3});
        }
    }
    CHECK(mapped_match);
    CHECK(same_as_narrow);
    CHECK(unmapped_differ);
    CHECK(throws<std::invalid_argument>([&] { kvp::select_victims_per_head(wide, protection, 1, 0.5, {7, 2, 9}); }));
    CHECK(throws<std::invalid_argument>([&] { kvp::select_victims_per_head(wide, protection, 1, 0.5, {7, 2, 9, 10}); }));
    CHECK(throws<std::invalid_argument>([&] { kvp::select_victims_per_head(wide, protection, 1, 0.0); }));
    std::printf("  evictor: per-head victims with head consensus and head columns\n");
}

// --- ledger image --------------------------------------------------------------------------------------------------

void test_ledger_image() {
    kvp::Ledger ledger(3);
    for (int64_t i = 0; i < 50; ++i) {
        ledger.append(i * 2, i * 2 + 1, i);
        for (int c = 0; c < 3; ++c) ledger.scores(size_t(i))[c] = float(i) + 0.25f * float(c);
    }
    ledger.remove({0, 7, 49});
    ledger.truncate(40);
    const std::vector<uint8_t> image = ledger.serialize();
    const kvp::Ledger copy = kvp::Ledger::deserialize(image.data(), image.size());
    CHECK(copy.size() == 40 && copy.n_columns() == 3);
    bool same = true;
    for (size_t i = 0; i < copy.size(); ++i) {
        same = same && copy.logical(i) == ledger.logical(i) && copy.original_pos(i) == ledger.original_pos(i) &&
               copy.cache_pos(i) == ledger.cache_pos(i) &&
               std::memcmp(copy.scores(i), ledger.scores(i), 3 * sizeof(float)) == 0;
    }
    CHECK(same);
    CHECK(copy.logical(0) == 2 && copy.logical(6) == 16 && copy.lower_bound(15) == 6);
    CHECK(copy.serialize() == image);
    const std::vector<uint8_t> empty = kvp::Ledger(2).serialize();
    CHECK(kvp::Ledger::deserialize(empty.data(), empty.size()).empty());

    auto rejected = ledger_image_rejected;
    auto with_u64 = [&](size_t offset, uint64_t value) {
        std::vector<uint8_t> bytes = image;
        std::memcpy(bytes.data() + offset, &value, sizeof value);
        return bytes;
    };
    CHECK(truncations_rejected(image, 7));
    std::vector<uint8_t> longer = image;
    longer.push_back(0);
    CHECK(rejected(longer));
    std::vector<uint8_t> bad_magic = image;
    bad_magic[0] ^= 1;
    CHECK(rejected(bad_magic));
    CHECK(rejected(with_u64(8, 0)));                  // no score columns
    CHECK(rejected(with_u64(8, uint64_t(1) << 40)));  // absurd column count
    CHECK(rejected(with_u64(16, 41)));                // one entry more than the bytes hold
    CHECK(rejected(with_u64(16, uint64_t(1) << 40)));  // absurd entry count
    std::printf("  ledger: image round trip and corrupt images\n");
}

// Per-head mode: which heads hold each entry travels with the image (a second magic, n_holders in the header).
void test_per_head_ledger_image() {
    kvp::Ledger ledger(2);
    ledger.set_holders(4);
    for (int64_t i = 0; i < 20; ++i) ledger.append(i, i, i);
    for (size_t i = 0; i < 20; ++i)
        for (int h = 0; h < 4; ++h)
            if ((i + size_t(h)) % 3 == 0) ledger.release(i, h);
    const std::vector<uint8_t> image = ledger.serialize();
    CHECK(std::memcmp(image.data(), "KVPLEDG2", 8) == 0);
    const kvp::Ledger copy = kvp::Ledger::deserialize(image.data(), image.size());
    bool same = copy.size() == 20 && copy.n_holders() == 4;
    for (size_t i = 0; same && i < 20; ++i)
        for (int h = 0; h < 4; ++h) same = same && copy.held(i, h) == ledger.held(i, h) && copy.logical(i) == int64_t(i);
    CHECK(same);
    CHECK(copy.serialize() == image);

    auto rejected = ledger_image_rejected;
    CHECK(truncations_rejected(image, 5));
    std::vector<uint8_t> no_holders = image;
    const uint64_t zero = 0;
    std::memcpy(no_holders.data() + 24, &zero, sizeof zero);  // n_holders 0 under the per-head magic
    CHECK(rejected(no_holders));
    std::vector<uint8_t> orphan = image;
    std::fill(orphan.end() - 4, orphan.end(), uint8_t(0));  // the last entry held by no head
    CHECK(rejected(orphan));
    std::printf("  ledger: per-head image round trip and corrupt images\n");
}


// Word-level eviction: every entry of a word takes, per column, the word's highest finite score; the evictor then
// drops whole words. Words are told apart by Ledger::word, so a word cut by an earlier eviction stays one word.
void test_word_scores() {
    using V = std::vector<size_t>;
    kvp::Ledger ledger(2);
    ledger.set_word_groups(true);
    //  logical   0  1  2  3  4  5  6  7  8  9
    //  word      0  1  1  1  4  5  5  7  8  9
    const int64_t word[] = {0, 1, 1, 1, 4, 5, 5, 7, 8, 9};
    const float column0[] = {9, 1, 6, 2, 3, 5, NAN, 4, 0, 9};
    for (int64_t i = 0; i < 10; ++i) {
        ledger.append(i, i, i, word[i], int32_t(100 + i));
        ledger.scores(size_t(i))[0] = column0[i];
        ledger.scores(size_t(i))[1] = float(-i);
    }
    CHECK(ledger.word(3) == 1 && ledger.token(3) == 103);
    kvp::Ledger shared = ledger;
    kvp::share_word_scores(shared);
    const float expected0[] = {9, 6, 6, 6, 3, 5, NAN, 4, 0, 9};
    const float expected1[] = {0, -1, -1, -1, -4, -5, -5, -7, -8, -9};
    bool same = true;
    for (size_t i = 0; i < 10; ++i) {
        const float a = shared.scores(i)[0];
        same = same && (std::isnan(expected0[i]) ? std::isnan(a) : a == expected0[i]) && shared.scores(i)[1] == expected1[i];
    }
    CHECK(same);
    // Column 0 alone: candidates 1..7 (one sink, two recent). The NaN leaves first, then word 4 (3), then word 7
    // (4); word 1 (6) outranks word 5 (5) as a whole though its tokens 1 and 3 score lowest on their own.
    kvp::Ledger one(1);
    one.set_word_groups(true);
    for (int64_t i = 0; i < 10; ++i) {
        one.append(i, i, i, word[i]);
        one.scores(size_t(i))[0] = column0[i];
    }
    kvp::share_word_scores(one);
    const kvp::Protection protection{1, 2};
    CHECK(kvp::select_victims(one, protection, 1, kvp::HeadCombine::mean) == V{6});
    CHECK(kvp::select_victims(one, protection, 3, kvp::HeadCombine::mean) == (V{4, 6, 7}));
    CHECK(kvp::select_victims(one, protection, 4, kvp::HeadCombine::mean) == (V{4, 5, 6, 7}));
    CHECK(kvp::select_victims(one, protection, 7, kvp::HeadCombine::mean) == (V{1, 2, 3, 4, 5, 6, 7}));
    // After token 2 is evicted, tokens 1 and 3 are still one word, ranked by the higher of their own scores (2)
    kvp::Ledger cut = one;
    for (size_t i = 0; i < 10; ++i) cut.scores(i)[0] = column0[i];
    cut.remove({2});
    kvp::share_word_scores(cut);
    CHECK(cut.word(1) == 1 && cut.word(2) == 1 && cut.scores(1)[0] == 2.0f && cut.scores(2)[0] == 2.0f);
    CHECK(kvp::eviction_unit_from_name("word") == kvp::EvictionUnit::word);
    CHECK(std::string(kvp::eviction_unit_name(kvp::EvictionUnit::token)) == "token");
    CHECK(throws<std::invalid_argument>([] { kvp::eviction_unit_from_name("letter"); }));
    CHECK(throws<std::logic_error>([&] { cut.set_word_groups(false); }));  // only on an empty ledger
    std::printf("  evictor: word-level scores\n");
}

// The stretch (select_victims with stretch > 0), against a reference written from its contract: candidates whose
// keep-score reaches stretch x the mean are confident; the first n_keep - confident candidates (backed off to a
// word's start) are kept whole; the rest is ranked as usual, ties to the older, by a full stable sort.
std::vector<size_t> reference_stretch_victims(const kvp::Ledger& ledger, kvp::Protection protection, size_t n_evict,
                                              kvp::HeadCombine combine, double stretch, size_t* kept_whole,
                                              std::vector<bool>* is_confident) {
    const std::vector<size_t> candidates = kvp::eviction_candidates(ledger, protection);
    const std::vector<double> keep = kvp::combined_keep_scores(ledger, candidates, combine);
    double total = 0.0;
    size_t finite = 0, confident = 0;
    for (double k : keep)
        if (std::isfinite(k)) total += k, ++finite;
    is_confident->clear();
    for (double k : keep) {
        is_confident->push_back(stretch > 0 && std::isfinite(k) && k >= stretch * total / double(finite));
        confident += is_confident->back();
    }
    const size_t n_keep = candidates.size() - n_evict;
    size_t length = stretch == 0.0 || n_keep <= confident ? 0 : n_keep - confident;
    while (length > 0 && length < candidates.size() &&
           ledger.word(candidates[length]) == ledger.word(candidates[length - 1]))
        --length;
    *kept_whole = length;
    std::vector<size_t> rest;
    for (size_t c = length; c < candidates.size(); ++c) rest.push_back(c);
    std::stable_sort(rest.begin(), rest.end(), [&](size_t a, size_t b) { return keep[a] < keep[b]; });
    std::vector<size_t> victims;
    for (size_t r = 0; r < n_evict; ++r) victims.push_back(candidates[rest[r]]);
    std::sort(victims.begin(), victims.end());
    return victims;
}

void test_stretch() {
    using V = std::vector<size_t>;
    const kvp::Protection protection{1, 1};
    // Twelve tokens, candidates logical 1..10, all scoring 0 but logical 8 (10): under sum_softmax 8 keeps almost
    // 1 and the others e^-10 each, so with a mean of 0.1 only 8 is confident at stretch 4. Keeping 5 of 10: a
    // stretch of 4 (logical 1..4) and 8.
    std::vector<std::vector<float>> spike(12, std::vector<float>{0.0f});
    spike[8][0] = 10.0f;
    std::vector<int64_t> logical(12);
    for (int64_t i = 0; i < 12; ++i) logical[size_t(i)] = i;
    const kvp::Ledger one = make_ledger(logical, spike);
    const std::vector<size_t> candidates = kvp::eviction_candidates(one, protection);
    const auto keep = kvp::combined_keep_scores(one, candidates, kvp::HeadCombine::sum_softmax);
    CHECK(kvp::stretch_length(one, candidates, keep, 5, 4.0) == 4);
    CHECK(kvp::stretch_length(one, candidates, keep, 5, 0.0) == 0);
    CHECK(kvp::select_victims(one, protection, 5, kvp::HeadCombine::sum_softmax, 4.0) == (V{5, 6, 7, 9, 10}));
    CHECK(kvp::select_victims(one, protection, 5, kvp::HeadCombine::sum_softmax) == (V{1, 2, 3, 4, 5}));
    // a threshold nothing reaches: the whole of what is kept is the stretch, like a sink of n_sink + n_keep
    CHECK(kvp::select_victims(one, protection, 5, kvp::HeadCombine::max_softmax, 20.0) == (V{6, 7, 8, 9, 10}));
    CHECK(kvp::select_victims(one, protection, 10, kvp::HeadCombine::sum_softmax, 4.0).size() == 10);
    // The stretch ends where a word does: logical 4 and 5 are one word, so it stops after 3, and the two kept
    // besides it are 8 and the newest of the tied rest (10).
    kvp::Ledger words(1);
    words.set_word_groups(true);
    for (int64_t i = 0; i < 12; ++i) {
        words.append(i, i, i, i == 5 ? 4 : i);
        words.scores(size_t(i))[0] = spike[size_t(i)][0];
    }
    CHECK(kvp::select_victims(words, protection, 5, kvp::HeadCombine::sum_softmax, 4.0) == (V{4, 5, 6, 7, 9}));
    CHECK(throws<std::invalid_argument>([&] { kvp::select_victims(one, protection, 5, kvp::HeadCombine::mean, 4.0); }));
    CHECK(throws<std::invalid_argument>([&] { kvp::select_victims(one, protection, 5, kvp::HeadCombine::sum_softmax, -1.0); }));
    CHECK(throws<std::invalid_argument>([&] { kvp::select_victims(one, protection, 5, kvp::HeadCombine::sum_softmax, NAN); }));

    // Random ledgers (three columns, words of one to three tokens, a few non-finite scores) against the reference,
    // and the contract's promise: no candidate of the stretch leaves, and neither does a confident one after it.
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 2.0f);
    bool same = true, promise = true;
    for (int trial = 0; trial < 300; ++trial) {
        const size_t n = 8 + rng() % 40;
        kvp::Ledger ledger(3);
        ledger.set_word_groups(true);
        int64_t word = 0;
        for (size_t i = 0; i < n; ++i) {
            if (rng() % 3 != 0) word = int64_t(i);
            ledger.append(int64_t(i), int64_t(i), int64_t(i), word);
            for (int c = 0; c < 3; ++c)
                ledger.scores(i)[c] = rng() % 50 == 0 ? NAN : normal(rng) * (rng() % 8 == 0 ? 4.0f : 1.0f);
        }
        kvp::share_word_scores(ledger);
        const kvp::Protection p{uint32_t(rng() % 3), uint32_t(1 + rng() % 3)};
        const std::vector<size_t> cand = kvp::eviction_candidates(ledger, p);
        if (cand.empty()) continue;
        const size_t n_evict = rng() % (cand.size() + 1);
        const double stretch = std::vector<double>{0.0, 0.5, 1.0, 2.0, 4.0}[rng() % 5];
        const auto combine = rng() % 2 ? kvp::HeadCombine::sum_softmax : kvp::HeadCombine::max_softmax;
        size_t kept_whole = 0;
        std::vector<bool> confident;
        const V expected = reference_stretch_victims(ledger, p, n_evict, combine, stretch, &kept_whole, &confident);
        const V victims = kvp::select_victims(ledger, p, n_evict, combine, stretch);
        same &= victims == expected;
        const size_t confident_after = size_t(std::count(confident.begin() + std::ptrdiff_t(kept_whole), confident.end(), true));
        const bool all_fit = cand.size() - n_evict - kept_whole >= confident_after;
        for (size_t c = 0; c < cand.size(); ++c) {
            const bool gone = std::binary_search(victims.begin(), victims.end(), cand[c]);
            if (gone && (c < kept_whole || (all_fit && confident[c]))) promise = false;
        }
    }
    CHECK(same);
    CHECK(promise);
    std::printf("  evictor: the stretch\n");
}

// Word groups travel with the image (a third magic): each entry's word and token id.
void test_word_ledger_image() {
    for (int n_holders : {0, 3}) {
        kvp::Ledger ledger(2);
        ledger.set_word_groups(true);
        if (n_holders) ledger.set_holders(n_holders);
        for (int64_t i = 0; i < 12; ++i) ledger.append(i, i, i, i - i % 3, int32_t(7 * i));
        ledger.remove({4});
        const std::vector<uint8_t> image = ledger.serialize();
        CHECK(std::memcmp(image.data(), "KVPLEDG3", 8) == 0);
        const kvp::Ledger copy = kvp::Ledger::deserialize(image.data(), image.size());
        bool same = copy.size() == 11 && copy.word_groups() && copy.n_holders() == n_holders;
        for (size_t i = 0; same && i < copy.size(); ++i)
            same = copy.word(i) == ledger.word(i) && copy.token(i) == ledger.token(i) && copy.logical(i) == ledger.logical(i);
        CHECK(same);
        CHECK(copy.serialize() == image);
        CHECK(truncations_rejected(image, 5));
        std::vector<uint8_t> late_word = image;  // entry 0's word starts after it
        const int64_t after = 5;
        std::memcpy(late_word.data() + 32 + 3 * 11 * sizeof(int64_t), &after, sizeof after);
        CHECK(ledger_image_rejected(late_word));
    }
    // Images without words (versions 1 and 2) read as one word per token.
    kvp::Ledger plain(1);
    for (int64_t i = 0; i < 4; ++i) plain.append(i, i, i);
    const std::vector<uint8_t> image = plain.serialize();
    CHECK(std::memcmp(image.data(), "KVPLEDG1", 8) == 0);
    const kvp::Ledger copy = kvp::Ledger::deserialize(image.data(), image.size());
    CHECK(!copy.word_groups() && copy.word(3) == 3 && copy.token(3) == -1);
    std::printf("  ledger: word image round trip and corrupt images\n");
}
}  // namespace

// KeyDiff in per-head mode: each head's anchor is the mean normalised key over the tokens that head holds, and
// the tokens it holds are scored against it (float64 reference).
void test_keydiff_per_head() {
    const kvp::ModelIdentity model{"test", 1, 2, 4, 4, 64};
    const std::unique_ptr<kvp::EvictionPolicy> policy = kvp::make_policy("keydiff", model, kvp::PolicyOptions{});
    constexpr int n = 7, heads = 2, dim = 4;
    std::mt19937 rng(11);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> k(n * heads * dim), v(n * heads * dim);
    for (float& x : k) x = normal(rng);
    for (float& x : v) x = normal(rng);
    kvp::Ledger ledger(policy->n_score_columns());
    CHECK(policy->n_score_columns() == heads);
    ledger.set_holders(heads);
    std::vector<int64_t> logical(n);
    for (int i = 0; i < n; ++i) {
        ledger.append(i, i, i);
        logical[size_t(i)] = i;
    }
    std::vector<float> rows(n * heads);
    policy->score_kv(0, kvp::HeadTokenView::contiguous(k.data(), n, heads, dim),
                     kvp::HeadTokenView::contiguous(v.data(), n, heads, dim), logical.data(), logical.data(),
                     rows.data(), heads);
    ledger.release(1, 0);  // head 0 no longer holds tokens 1 and 4; head 1 holds everything
    ledger.release(4, 0);
    policy->refresh_scores(ledger);
    for (int h = 0; h < heads; ++h) {
        double anchor[dim] = {0, 0, 0, 0};
        int held = 0;
        for (int i = 0; i < n; ++i) {
            if (!ledger.held(size_t(i), h)) continue;
            const float* key = k.data() + (i * heads + h) * dim;
            double norm = 0;
            for (int c = 0; c < dim; ++c) norm += double(key[c]) * key[c];
            for (int c = 0; c < dim; ++c) anchor[c] += key[c] / std::sqrt(norm);
            ++held;
        }
        CHECK(held == (h == 0 ? n - 2 : n));
        for (double& a : anchor) a /= held;
        for (int i = 0; i < n; ++i) {
            if (!ledger.held(size_t(i), h)) continue;
            const float* key = k.data() + (i * heads + h) * dim;
            double dot = 0, key_norm = 0, anchor_norm = 0;
            for (int c = 0; c < dim; ++c) {
                dot += key[c] * anchor[c];
                key_norm += double(key[c]) * key[c];
                anchor_norm += anchor[c] * anchor[c];
            }
            const double expected = -dot / (std::sqrt(key_norm) * std::sqrt(anchor_norm));
            CHECK(std::fabs(ledger.scores(size_t(i))[h] - expected) < 1e-5);
        }
    }
}

int main(int argc, char** argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: %s POLICY.kvp.bin...\n", argv[0]);
        return 2;
    }
    try {
        for (int i = 1; i < argc; ++i) {
            const std::vector<uint8_t> file = read_file(argv[i]);
            const auto policy = std::make_shared<const kvp::Policy>(kvp::load_policy(argv[i]));
            test_format_round_trip(argv[i], file, *policy);
            test_scorer(policy, uint32_t(i));
            test_recency_terms(policy);
        }
        test_evictor();
        test_evictor_per_head();
        test_ledger_image();
        test_per_head_ledger_image();
        test_word_scores();
        test_stretch();
        test_word_ledger_image();
        test_keydiff_per_head();
    } catch (const std::exception& e) {
        std::fprintf(stderr, "test_core: unexpected exception: %s\n", e.what());
        return 1;
    }
    std::printf("test_core: %d checks, %d failed\n", g_checks, g_failures);
    return g_failures == 0 ? 0 : 1;
}
