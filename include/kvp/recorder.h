// The recorder: copies named graph nodes out of llama.cpp's decode through the eval callback, for offline work
// (training traces, checking recomputed attention against llama.cpp's own). Not used on the inference path.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

struct ggml_tensor;

namespace kvp {

class Recorder {
public:
    struct Capture {
        std::string name;              // without the layer suffix, e.g. "Kcur"
        int layer = -1;
        std::array<int64_t, 4> ne{};   // ggml order: ne[0] is the fastest-varying dimension
        std::vector<float> data;       // dense, ne[0] * ne[1] * ne[2] * ne[3] floats
    };

    // Captures "<name>-<layer>" nodes for each name, for the given layers (empty: all). For Qcur and Kcur the
    // post-RoPE node is taken, for Vcur the [head_dim, n_head_kv, tokens] reshape; for any other name every F32
    // node with exactly that name.
    Recorder(std::vector<std::string> names, std::vector<int> layers);

    static bool eval_callback(ggml_tensor* tensor, bool ask, void* user_data);

    const std::vector<Capture>& captures() const { return captures_; }
    std::vector<Capture> take();  // returns and clears
    size_t bytes() const;

private:
    bool wants(const ggml_tensor* t, int* name_index, int* layer) const;
    void record(const ggml_tensor* t, int name_index, int layer);

    std::vector<std::string> names_;
    std::vector<int> layers_;  // sorted; empty = all
    std::vector<Capture> captures_;
};

}  // namespace kvp
