// kvp.bin reader. The byte layout and the rejection rules are in docs/kvp-bin-format.md; python/kvp_cpp/policy_file.py
// implements the same checks in the same order, so both readers name the same problem for the same bad file.
#include "kvp/format.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

namespace kvp {
namespace {

// Header field offsets (docs/kvp-bin-format.md, "Layout").
constexpr size_t kOffVersion = 8;
constexpr size_t kOffHeaderBytes = 12;
constexpr size_t kOffFileBytes = 16;
constexpr size_t kOffArch = 24;
constexpr size_t kArchBytes = 32;
constexpr size_t kOffNLayer = 56;
constexpr size_t kOffNHeadKv = 60;
constexpr size_t kOffHeadDimK = 64;
constexpr size_t kOffHeadDimV = 68;
constexpr size_t kOffNCtxTrain = 72;
constexpr size_t kOffNPosFeatures = 76;
constexpr size_t kOffNDense = 80;
constexpr size_t kOffHidden = 84;
constexpr size_t kOffActivation = 96;
constexpr size_t kOffWeightDtype = 100;
constexpr size_t kOffNSink = 104;
constexpr size_t kOffNRecent = 108;
constexpr size_t kOffMetadataBytes = 112;
constexpr size_t kOffRecencyKnots = 120;  // version 2; reserved (zero) in version 1
constexpr size_t kOffReserved = 124;

constexpr size_t kChecksumBytes = 4;
constexpr size_t kPosFeatureBytes = 8;  // u32 kind + f32 a
constexpr uint64_t kMaxLoadBytes = uint64_t{2} << 30;

struct RangedField {
    const char* name;
    size_t offset;
    uint32_t min;
    uint32_t max;
};

// The u32 header fields with a plain range, in the order they are checked.
constexpr RangedField kRangedFields[] = {
    {"n_layer", kOffNLayer, 1, 1024},
    {"n_head_kv", kOffNHeadKv, 1, 256},
    {"head_dim_k", kOffHeadDimK, 1, 1024},
    {"head_dim_v", kOffHeadDimV, 1, 1024},
    {"n_ctx_train", kOffNCtxTrain, 1, std::numeric_limits<uint32_t>::max()},
    {"n_pos_features", kOffNPosFeatures, 0, kMaxPosFeatures},
    {"n_dense", kOffNDense, 1, kMaxDense},
    {"activation", kOffActivation, 0, 3},
    {"weight_dtype", kOffWeightDtype, 0, 1},
};

[[noreturn]] void fail(const std::string& message) { throw FormatError(message); }

uint16_t read_u16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

uint32_t read_u32(const uint8_t* p) {
    return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) | (static_cast<uint32_t>(p[2]) << 16) |
           (static_cast<uint32_t>(p[3]) << 24);
}

uint64_t read_u64(const uint8_t* p) { return read_u32(p) | (static_cast<uint64_t>(read_u32(p + 4)) << 32); }

float read_f32(const uint8_t* p) { return std::bit_cast<float>(read_u32(p)); }

float half_to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1fu;
    const uint32_t mantissa = h & 0x3ffu;
    if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in f32
        const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
        return sign ? -magnitude : magnitude;
    }
    if (exponent == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));  // inf / nan
    return std::bit_cast<float>(sign | ((exponent + (127 - 15)) << 23) | (mantissa << 13));
}

uint64_t checked_add(uint64_t a, uint64_t b) {
    uint64_t r;
    if (__builtin_add_overflow(a, b, &r)) fail("section sizes overflow 64 bits");
    return r;
}

uint64_t checked_mul(uint64_t a, uint64_t b) {
    uint64_t r;
    if (__builtin_mul_overflow(a, b, &r)) fail("section sizes overflow 64 bits");
    return r;
}

// Offset of the first byte that is not part of well-formed UTF-8 (Unicode table 3-7: no overlong forms, no
// surrogates, nothing above U+10FFFF), or `size` if all of it is well-formed. Python's strict decoder agrees.
size_t utf8_error_offset(const uint8_t* s, size_t size) {
    size_t i = 0;
    while (i < size) {
        const uint8_t c = s[i];
        size_t n;
        uint8_t lo = 0x80, hi = 0xbf;  // allowed range of the second byte
        if (c < 0x80) {
            ++i;
            continue;
        } else if (c >= 0xc2 && c <= 0xdf) {
            n = 1;
        } else if (c >= 0xe0 && c <= 0xef) {
            n = 2;
            if (c == 0xe0) lo = 0xa0;
            if (c == 0xed) hi = 0x9f;
        } else if (c >= 0xf0 && c <= 0xf4) {
            n = 3;
            if (c == 0xf0) lo = 0x90;
            if (c == 0xf4) hi = 0x8f;
        } else {
            return i;
        }
        if (n > size - i - 1) return i;
        if (s[i + 1] < lo || s[i + 1] > hi) return i;
        for (size_t k = 2; k <= n; ++k)
            if ((s[i + k] & 0xc0) != 0x80) return i;
        i += n + 1;
    }
    return size;
}

bool is_json_space(uint8_t c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

// Bounds-checked sequential reader over the validated file image.
class Cursor {
public:
    Cursor(const uint8_t* data, size_t end, size_t pos) : data_(data), end_(end), pos_(pos) {}

    const uint8_t* take(uint64_t n, const char* what) {
        if (n > end_ - pos_) fail(std::string("file ends inside ") + what);
        const uint8_t* p = data_ + pos_;
        pos_ += static_cast<size_t>(n);
        return p;
    }
    size_t pos() const { return pos_; }

private:
    const uint8_t* data_;
    size_t end_;
    size_t pos_;
};

void check_arch(const uint8_t* field, std::string& arch) {
    const uint8_t* nul = static_cast<const uint8_t*>(std::memchr(field, 0, kArchBytes));
    if (nul == nullptr) fail("arch has no NUL terminator within its 32 bytes");
    const size_t length = static_cast<size_t>(nul - field);
    if (length == 0) fail("arch is empty");
    for (size_t i = length; i < kArchBytes; ++i)
        if (field[i] != 0) fail("arch is not NUL-padded after its terminator");
    if (utf8_error_offset(field, length) != length) fail("arch is not valid UTF-8");
    arch.assign(reinterpret_cast<const char*>(field), length);
}

std::string agent_name(uint32_t layer, uint32_t head) {
    return "agent (layer " + std::to_string(layer) + ", head " + std::to_string(head) + ")";
}

// Reads `count` values of `dtype` into out, failing on the first non-finite value.
void read_values(Cursor& cursor, WeightDtype dtype, size_t count, std::vector<float>& out, uint32_t layer,
                 uint32_t head, const std::string& what) {
    const size_t width = dtype == WeightDtype::f16 ? 2 : 4;
    const uint8_t* p = cursor.take(checked_mul(count, width), "the agents");
    out.resize(count);
    for (size_t i = 0; i < count; ++i) {
        const float value = dtype == WeightDtype::f16 ? half_to_float(read_u16(p + i * 2)) : read_f32(p + i * 4);
        if (!std::isfinite(value))
            fail(agent_name(layer, head) + ": " + what + "[" + std::to_string(i) + "] is not finite");
        out[i] = value;
    }
}

}  // namespace

std::string ModelIdentity::to_string() const {
    std::ostringstream s;
    s << arch << " n_layer=" << n_layer << " n_head_kv=" << n_head_kv << " head_dim_k=" << head_dim_k
      << " head_dim_v=" << head_dim_v << " n_ctx_train=" << n_ctx_train;
    return s.str();
}

uint32_t crc32_ieee(const uint8_t* data, size_t size, uint32_t crc) {
    static constexpr std::array<uint32_t, 256> table = [] {
        std::array<uint32_t, 256> t{};
        for (uint32_t i = 0; i < 256; ++i) {
            uint32_t c = i;
            for (int k = 0; k < 8; ++k) c = (c & 1u) ? 0xedb88320u ^ (c >> 1) : c >> 1;
            t[i] = c;
        }
        return t;
    }();
    crc = ~crc;
    for (size_t i = 0; i < size; ++i) crc = table[(crc ^ data[i]) & 0xffu] ^ (crc >> 8);
    return ~crc;
}

void compute_pos_features(const std::vector<PosFeature>& features, int64_t position, float* out) {
    const double p = static_cast<double>(position);
    for (size_t i = 0; i < features.size(); ++i) {
        const double a = features[i].a;
        double value;
        switch (features[i].kind) {
            case PosFeatureKind::linear: value = p / a; break;
            case PosFeatureKind::log: value = std::log(1.0 + p) / a; break;
            case PosFeatureKind::sine: value = std::sin(p * a); break;
            case PosFeatureKind::cosine: value = std::cos(p * a); break;
            default: fail("position feature " + std::to_string(i) + " has an unknown kind");
        }
        out[i] = static_cast<float>(value);
    }
}

double recency_term(const float* knots, uint32_t n_knots, int64_t age) {
    if (n_knots == 0) return 0.0;
    const double u = std::min(std::log2(static_cast<double>(std::max<int64_t>(age, 1))), double(n_knots - 1));
    const uint32_t j = std::min(static_cast<uint32_t>(u), n_knots >= 2 ? n_knots - 2 : 0u);
    const double t = u - j;
    const uint32_t upper = std::min(j + 1, n_knots - 1);
    return (1.0 - t) * knots[j] + t * knots[upper];
}

Policy parse_policy(const uint8_t* data, size_t size) {
    if (size < kHeaderBytes)
        fail("file is " + std::to_string(size) + " bytes, shorter than the " + std::to_string(kHeaderBytes) +
             "-byte header");
    if (std::memcmp(data, kPolicyMagic, sizeof(kPolicyMagic)) != 0) fail("bad magic: not a kvp.bin policy file");
    const uint32_t version = read_u32(data + kOffVersion);
    if (version != 1 && version != 2) fail("version=" + std::to_string(version) + " is not supported (expected 1 or 2)");
    const uint32_t header_bytes = read_u32(data + kOffHeaderBytes);
    if (header_bytes != kHeaderBytes)
        fail("header_bytes=" + std::to_string(header_bytes) + " (expected " + std::to_string(kHeaderBytes) + ")");
    const uint64_t file_bytes = read_u64(data + kOffFileBytes);
    if (file_bytes != size)
        fail("file_bytes=" + std::to_string(file_bytes) + " but the file is " + std::to_string(size) + " bytes");
    if (size < kHeaderBytes + kChecksumBytes)
        fail("file is " + std::to_string(size) + " bytes, too short to hold the checksum after the header");
    const size_t body_bytes = size - kChecksumBytes;
    const uint32_t stored_crc = read_u32(data + body_bytes);
    const uint32_t computed_crc = crc32_ieee(data, body_bytes);
    if (stored_crc != computed_crc) {
        std::ostringstream s;
        s << std::hex << "checksum mismatch: stored 0x" << stored_crc << ", computed 0x" << computed_crc;
        fail(s.str());
    }

    Policy policy;
    check_arch(data + kOffArch, policy.identity.arch);
    for (const RangedField& field : kRangedFields) {
        const uint32_t value = read_u32(data + field.offset);
        if (value < field.min || value > field.max)
            fail(std::string(field.name) + "=" + std::to_string(value) + " is outside " + std::to_string(field.min) +
                 ".." + std::to_string(field.max));
    }
    const uint32_t n_dense = read_u32(data + kOffNDense);
    for (uint32_t j = 0; j < kMaxDense - 1; ++j) {
        const uint32_t width = read_u32(data + kOffHidden + 4 * j);
        const bool used = j + 1 < n_dense;
        if (used && (width < 1 || width > kMaxHidden))
            fail("hidden[" + std::to_string(j) + "]=" + std::to_string(width) + " is outside 1.." +
                 std::to_string(kMaxHidden));
        if (!used && width != 0)
            fail("hidden[" + std::to_string(j) + "]=" + std::to_string(width) + " must be 0 (n_dense=" +
                 std::to_string(n_dense) + ")");
        if (used) policy.hidden.push_back(width);
    }
    const uint64_t metadata_bytes = read_u64(data + kOffMetadataBytes);
    if (metadata_bytes > kMaxMetadataBytes)
        fail("metadata_bytes=" + std::to_string(metadata_bytes) + " is more than " +
             std::to_string(kMaxMetadataBytes));
    const uint32_t n_recency_knots = read_u32(data + kOffRecencyKnots);
    if (version == 1 && n_recency_knots != 0) fail("reserved header bytes are not zero");
    if (version == 2 && (n_recency_knots < 1 || n_recency_knots > kMaxRecencyKnots))
        fail("n_recency_knots=" + std::to_string(n_recency_knots) + " is outside 1.." +
             std::to_string(kMaxRecencyKnots));
    if (read_u32(data + kOffReserved) != 0) fail("reserved header bytes are not zero");
    policy.n_recency_knots = n_recency_knots;

    ModelIdentity& id = policy.identity;
    id.n_layer = read_u32(data + kOffNLayer);
    id.n_head_kv = read_u32(data + kOffNHeadKv);
    id.head_dim_k = read_u32(data + kOffHeadDimK);
    id.head_dim_v = read_u32(data + kOffHeadDimV);
    id.n_ctx_train = read_u32(data + kOffNCtxTrain);
    const uint32_t n_pos_features = read_u32(data + kOffNPosFeatures);
    policy.activation = static_cast<Activation>(read_u32(data + kOffActivation));
    policy.weight_dtype = static_cast<WeightDtype>(read_u32(data + kOffWeightDtype));
    policy.n_sink = read_u32(data + kOffNSink);
    policy.n_recent = read_u32(data + kOffNRecent);

    // Everything but the agents must fit before the layer flags can be read to count the agents.
    uint64_t fixed_bytes = checked_add(kHeaderBytes, checked_mul(n_pos_features, kPosFeatureBytes));
    fixed_bytes = checked_add(fixed_bytes, checked_mul(id.n_layer, 4));
    fixed_bytes = checked_add(fixed_bytes, checked_add(metadata_bytes, kChecksumBytes));
    if (fixed_bytes > file_bytes)
        fail("file_bytes=" + std::to_string(file_bytes) + " is less than the " + std::to_string(fixed_bytes) +
             " bytes the header, position features, layer flags, metadata and checksum need");

    const uint8_t* flags = data + kHeaderBytes + n_pos_features * kPosFeatureBytes;
    uint32_t n_scored = 0;
    for (uint32_t layer = 0; layer < id.n_layer; ++layer) {
        const uint32_t flag = read_u32(flags + 4 * layer);
        if (flag & ~1u)
            fail("layer flag of layer " + std::to_string(layer) + " is " + std::to_string(flag) +
                 "; only bit 0 may be set");
        n_scored += flag & 1u;
    }
    if (n_scored == 0) fail("layer flags: no layer has agents");

    const uint64_t input_dim = uint64_t{id.head_dim_k} + id.head_dim_v + n_pos_features;
    const uint64_t value_bytes = policy.weight_dtype == WeightDtype::f16 ? 2 : 4;
    uint64_t agent_bytes = checked_mul(2 * 4, input_dim);
    uint64_t n_in = input_dim;
    for (uint32_t j = 0; j < n_dense; ++j) {
        const uint64_t n_out = j + 1 < n_dense ? policy.hidden[j] : 1;
        agent_bytes = checked_add(agent_bytes, checked_mul(checked_add(checked_mul(n_out, n_in), n_out), value_bytes));
        n_in = n_out;
    }
    agent_bytes = checked_add(agent_bytes, uint64_t{n_recency_knots} * 4);
    const uint64_t total_bytes =
        checked_add(fixed_bytes, checked_mul(checked_mul(n_scored, id.n_head_kv), agent_bytes));
    if (total_bytes != file_bytes)
        fail("file_bytes=" + std::to_string(file_bytes) + " but the sections require " +
             std::to_string(total_bytes) + " bytes");

    // From here every section is known to lie inside the file; the cursor re-checks anyway.
    Cursor cursor(data, body_bytes, kHeaderBytes);
    for (uint32_t i = 0; i < n_pos_features; ++i) {
        const uint8_t* record = cursor.take(kPosFeatureBytes, "the position features");
        const uint32_t kind = read_u32(record);
        const float a = read_f32(record + 4);
        const std::string name = "position feature " + std::to_string(i);
        if (kind > static_cast<uint32_t>(PosFeatureKind::cosine))
            fail(name + ": kind=" + std::to_string(kind) + " is outside 0..3");
        if (!std::isfinite(a)) fail(name + ": a is not finite");
        if (a == 0.0f && kind <= static_cast<uint32_t>(PosFeatureKind::log))
            fail(name + ": a is zero for a linear or log feature");
        policy.pos_features.push_back({static_cast<PosFeatureKind>(kind), a});
    }
    cursor.take(uint64_t{id.n_layer} * 4, "the layer flags");
    policy.layer_scored.resize(id.n_layer);
    for (uint32_t layer = 0; layer < id.n_layer; ++layer) policy.layer_scored[layer] = read_u32(flags + 4 * layer) & 1u;

    policy.agents.resize(size_t{id.n_layer} * id.n_head_kv);
    for (uint32_t layer = 0; layer < id.n_layer; ++layer) {
        if (!policy.layer_scored[layer]) continue;
        for (uint32_t head = 0; head < id.n_head_kv; ++head) {
            Agent& agent = policy.agents[size_t{layer} * id.n_head_kv + head];
            read_values(cursor, WeightDtype::f32, input_dim, agent.shift, layer, head, "shift");
            read_values(cursor, WeightDtype::f32, input_dim, agent.scale, layer, head, "scale");
            uint32_t layer_in = static_cast<uint32_t>(input_dim);
            for (uint32_t j = 0; j < n_dense; ++j) {
                DenseLayer& dense = agent.dense.emplace_back();
                dense.n_in = layer_in;
                dense.n_out = j + 1 < n_dense ? policy.hidden[j] : 1;
                const std::string prefix = "dense " + std::to_string(j) + " ";
                read_values(cursor, policy.weight_dtype, size_t{dense.n_out} * dense.n_in, dense.weight, layer, head,
                            prefix + "weight");
                read_values(cursor, policy.weight_dtype, dense.n_out, dense.bias, layer, head, prefix + "bias");
                layer_in = dense.n_out;
            }
        }
    }

    for (uint32_t layer = 0; layer < id.n_layer && n_recency_knots; ++layer) {
        if (!policy.layer_scored[layer]) continue;
        for (uint32_t head = 0; head < id.n_head_kv; ++head)
            read_values(cursor, WeightDtype::f32, n_recency_knots, policy.agents[size_t{layer} * id.n_head_kv + head].recency,
                        layer, head, "recency");
    }

    const uint8_t* metadata = cursor.take(metadata_bytes, "the metadata");
    const size_t metadata_size = static_cast<size_t>(metadata_bytes);
    const size_t bad_utf8 = utf8_error_offset(metadata, metadata_size);
    if (bad_utf8 != metadata_size) fail("metadata is not valid UTF-8 (byte offset " + std::to_string(bad_utf8) + ")");
    size_t first = 0, last = metadata_size;
    while (first < last && is_json_space(metadata[first])) ++first;
    while (last > first && is_json_space(metadata[last - 1])) --last;
    if (last - first < 2 || metadata[first] != '{' || metadata[last - 1] != '}')
        fail("metadata is not a JSON object");
    policy.metadata_json.assign(reinterpret_cast<const char*>(metadata), metadata_size);
    if (cursor.pos() != body_bytes) fail("file_bytes does not match the sections");
    return policy;
}

std::vector<uint8_t> read_policy_file(const std::string& path) {
    std::error_code ec;
    const uintmax_t size = std::filesystem::file_size(path, ec);
    if (ec) fail("cannot read policy file '" + path + "': " + ec.message());
    if (size > kMaxLoadBytes)
        fail("policy file '" + path + "' is " + std::to_string(size) + " bytes, more than the 2 GiB limit");
    std::ifstream in(path, std::ios::binary);
    if (!in) fail("cannot open policy file '" + path + "': " + std::strerror(errno));
    std::vector<uint8_t> bytes(static_cast<size_t>(size));
    in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    if (static_cast<uintmax_t>(in.gcount()) != size || in.peek() != std::char_traits<char>::eof())
        fail("policy file '" + path + "' changed size while being read");
    return bytes;
}

Policy parse_policy_file(const std::vector<uint8_t>& image, const std::string& path) {
    try {
        return parse_policy(image.data(), image.size());
    } catch (const FormatError& e) {
        throw FormatError("policy file '" + path + "': " + e.what());
    }
}

Policy load_policy(const std::string& path) { return parse_policy_file(read_policy_file(path), path); }

void check_identity(const Policy& policy, const ModelIdentity& model) {
    const ModelIdentity& trained = policy.identity;
    std::string differing;
    auto compare = [&](const char* name, bool same) {
        if (same) return;
        if (!differing.empty()) differing += ", ";
        differing += name;
    };
    compare("arch", trained.arch == model.arch);
    compare("n_layer", trained.n_layer == model.n_layer);
    compare("n_head_kv", trained.n_head_kv == model.n_head_kv);
    compare("head_dim_k", trained.head_dim_k == model.head_dim_k);
    compare("head_dim_v", trained.head_dim_v == model.head_dim_v);
    compare("n_ctx_train", trained.n_ctx_train == model.n_ctx_train);
    if (!differing.empty())
        fail("policy was trained for " + trained.to_string() + " but the model is " + model.to_string() +
             " (differing: " + differing + ")");
}

}  // namespace kvp
