// The patched llama.cpp's in-graph scoring (llama_kvp_scorer_*): a learned policy's MLP runs inside the decode
// graph, on the backend that computes each layer, and the scores come back once per ubatch instead of K and V
// through the eval callback. The functions are looked up in the libllama this process loaded.
#pragma once

#include <cstdint>
#include <vector>

#include "llama.h"

#include "kvp/format.h"

namespace kvp {

class GraphScorer {
public:
    // Whether the loaded libllama has llama_kvp_scorer_*.
    static bool available();

    explicit GraphScorer(const Policy& policy);  // throws std::runtime_error if !available()

    // Uploads the MLP of every scored layer to ctx, replacing whatever scorer ctx had.
    void upload(llama_context* ctx);
    // Whether ctx still runs this scorer (another engine on the same context may have uploaded its own since).
    bool current(llama_context* ctx) const;
    // Features of the next decode's tokens are computed at cache position + offset (their original position).
    void set_pos_offset(llama_context* ctx, int64_t offset) const;
    // The scores of one layer for the tokens of the last llama_decode, [n][n_head_kv]; null if llama.cpp has none.
    const float* scores(llama_context* ctx, int layer, int64_t* n_tokens) const;

    const std::vector<int>& layers() const { return layers_; }

    // the llama_kvp_scorer_* functions
    struct Functions {
        int32_t (*init)(llama_context*, int32_t, const int32_t*, int32_t, int32_t, const int32_t*, const float*);
        int32_t (*set_layer)(llama_context*, int32_t, const float*, const float*, const float* const*,
                             const float* const*);
        void (*set_pos_offset)(llama_context*, llama_pos);
        const float* (*scores)(llama_context*, int32_t, int32_t*);
    };

private:
    const Policy& policy_;
    std::vector<int> layers_;
    Functions fn_;
};

}  // namespace kvp
