// kvp.bin policy file: in-memory model and loader. The byte layout is specified in docs/kvp-bin-format.md:
//   header (128 B) | position features | layer flags | agents | recency terms (version 2) | metadata JSON | CRC-32
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvp {

inline constexpr char kPolicyMagic[8] = {'K', 'V', 'P', 'O', 'L', 'I', 'C', 'Y'};
inline constexpr uint32_t kPolicyVersion = 2;  // the newest; version 1 (no recency terms) is read too
inline constexpr uint32_t kHeaderBytes = 128;
inline constexpr uint32_t kMaxPosFeatures = 16;
inline constexpr uint32_t kMaxDense = 4;
inline constexpr uint32_t kMaxHidden = 4096;
inline constexpr uint64_t kMaxMetadataBytes = 16u << 20;
inline constexpr uint32_t kMaxRecencyKnots = 32;

// Thrown for every malformed, truncated, inconsistent or mismatched policy file; the message names the problem.
class FormatError : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

enum class Activation : uint32_t { relu = 0, silu = 1, gelu_tanh = 2, tanh = 3 };
enum class WeightDtype : uint32_t { f32 = 0, f16 = 1 };
enum class PosFeatureKind : uint32_t { linear = 0, log = 1, sine = 2, cosine = 3 };

struct PosFeature {
    PosFeatureKind kind;
    float a;
};

// What a policy was trained for; must equal the GGUF model's.
struct ModelIdentity {
    std::string arch;
    uint32_t n_layer = 0;
    uint32_t n_head_kv = 0;
    uint32_t head_dim_k = 0;
    uint32_t head_dim_v = 0;
    uint32_t n_ctx_train = 0;

    bool operator==(const ModelIdentity&) const = default;
    std::string to_string() const;
};

// One dense layer, weights already widened to f32. `weight` is n_out x n_in row-major, as in the file.
struct DenseLayer {
    uint32_t n_in = 0;
    uint32_t n_out = 0;
    std::vector<float> weight;
    std::vector<float> bias;
};

// The agent of one (layer, KV head).
struct Agent {
    std::vector<float> shift;  // D
    std::vector<float> scale;  // D
    std::vector<DenseLayer> dense;
    std::vector<float> recency;  // the recency term's n_recency_knots values (recency_term); empty without one
};

struct Policy {
    ModelIdentity identity;
    std::vector<PosFeature> pos_features;
    std::vector<uint32_t> hidden;  // widths of the hidden layers (n_dense - 1 entries)
    Activation activation = Activation::relu;
    WeightDtype weight_dtype = WeightDtype::f32;
    uint32_t n_sink = 4;
    uint32_t n_recent = 16;
    uint32_t n_recency_knots = 0;    // 0: no recency term (a version 1 file)
    std::vector<bool> layer_scored;  // n_layer
    // n_layer * n_head_kv entries, index layer * n_head_kv + head; empty Agent (no dense layers) for unscored layers.
    std::vector<Agent> agents;
    std::string metadata_json;

    uint32_t input_dim() const {
        return identity.head_dim_k + identity.head_dim_v + static_cast<uint32_t>(pos_features.size());
    }
    const Agent& agent(uint32_t layer, uint32_t head) const { return agents[layer * identity.n_head_kv + head]; }
};

// Parses a complete file image. Throws FormatError on anything that does not follow the spec.
Policy parse_policy(const uint8_t* data, size_t size);
// The whole file, read with ordinary reads (never mmap). Throws FormatError for I/O errors and files over 2 GiB.
std::vector<uint8_t> read_policy_file(const std::string& path);
// Parses the image of the file at `path`; errors name the path.
Policy parse_policy_file(const std::vector<uint8_t>& image, const std::string& path);
// read_policy_file, then parse_policy_file.
Policy load_policy(const std::string& path);

// Throws FormatError naming every field that differs.
void check_identity(const Policy& policy, const ModelIdentity& model);

uint32_t crc32_ieee(const uint8_t* data, size_t size, uint32_t crc = 0);

// Position feature values for one original position, written to out[0 .. pos_features.size()).
void compute_pos_features(const std::vector<PosFeature>& features, int64_t position, float* out);

// An agent's recency term for a token of `age` >= 1 (the next position to be written minus the token's original
// position): linear in log2(age) between the knots at ages 2^0 .. 2^(n-1), constant beyond the last. The evictor
// ranks by the MLP score plus this. Computed in double precision (docs/kvp-bin-format.md, "Recency terms").
double recency_term(const float* knots, uint32_t n_knots, int64_t age);

}  // namespace kvp
