// One llama.cpp model and context driven by kvp-bench: sequence 0 only, a fixed eval callback that forwards to the
// engines currently following the sequence, decode counters, and sequence state save/restore.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "llama.h"

struct ggml_tensor;

namespace kvp {
class Engine;
}

namespace kvp::bench {

class Model {
public:
    explicit Model(const std::string& path);
    ~Model();
    Model(const Model&) = delete;
    Model& operator=(const Model&) = delete;

    const llama_model* get() const { return model_; }
    llama_model* get() { return model_; }
    const llama_vocab* vocab() const { return vocab_; }
    int32_t n_vocab() const { return llama_vocab_n_tokens(vocab_); }
    // With the model's BOS if it wants one (SmolLM2 does not); special tokens in the text are parsed.
    std::vector<llama_token> tokenize(const std::string& text) const;
    std::string detokenize(const std::vector<llama_token>& tokens) const;
    bool is_end_of_generation(llama_token token) const { return llama_vocab_is_eog(vocab_, token); }
    // Bytes of K and V per cell over all layers, for F16 caches.
    int64_t kv_bytes_per_cell() const;

private:
    llama_model* model_ = nullptr;
    const llama_vocab* vocab_ = nullptr;
};

struct ContextOptions {
    int64_t n_ctx = 0;
    int n_batch = 512;
    int n_threads = 0;  // 0: llama.cpp's default (GGML_DEFAULT_N_THREADS)
    std::string flash_attn = "auto";
    bool eval_callback = true;  // false: no callback at all, as llama.cpp runs without kvp (no engine may listen)
};

struct DecodeCounters {
    int64_t calls = 0;   // llama_decode calls
    int64_t tokens = 0;  // tokens submitted to llama_decode
};

// Called with the index (into the fed tokens) and the logits row of each token whose logits were asked for.
using LogitsSink = std::function<void(size_t index, const float* logits)>;

class Session {
public:
    Session(Model& model, const ContextOptions& options);
    ~Session();
    Session(const Session&) = delete;
    Session& operator=(const Session&) = delete;

    Model& model() { return model_; }
    llama_context* context() { return ctx_; }
    int64_t n_ctx() const { return int64_t(llama_n_ctx(ctx_)); }
    int n_batch() const { return n_batch_; }
    const DecodeCounters& counters() const { return counters_; }

    // The engines that receive the eval callback from now on (those that need no capture are skipped).
    void listen(const std::vector<Engine*>& engines);

    // llama_decode of one batch of sequence 0 at positions first_pos.., with logits for tokens[logits_from..].
    void decode(std::span<const llama_token> tokens, int64_t first_pos, size_t logits_from, const LogitsSink& on_logits);

    void clear_sequence();
    std::vector<uint8_t> save_sequence();
    void restore_sequence(const std::vector<uint8_t>& state);
    // Cells llama.cpp itself holds for sequence 0, read from its serialised state (llama.h has no counter);
    // -1 if the layout is not the one known (src/llama-context.cpp state_seq_get_data, llama-kv-cache.cpp state_write).
    int64_t cells_in_use();

private:
    static bool eval_callback(ggml_tensor* tensor, bool ask, void* user_data);

    Model& model_;
    llama_context* ctx_ = nullptr;
    llama_batch batch_{};
    int n_batch_ = 0;
    std::vector<Engine*> listeners_;
    bool has_callback_ = true;
    DecodeCounters counters_;
};

// Writes tokens into sequence 0 after what it already holds, through the engines that follow the sequence
// (all of them see every batch: they share one prefill), or with plain consecutive positions when there are none
// (the full cache). The engines listen to the eval callback for the writer's lifetime.
class SequenceWriter {
public:
    SequenceWriter(Session& session, std::vector<Engine*> engines, int64_t next_pos);
    ~SequenceWriter();
    SequenceWriter(const SequenceWriter&) = delete;
    SequenceWriter& operator=(const SequenceWriter&) = delete;

    // Decodes `tokens` in batches (the engines choose their sizes and evict before each one), calling on_logits for
    // tokens[logits_from..].
    void feed(std::span<const llama_token> tokens, size_t logits_from, const LogitsSink& on_logits);
    void feed(std::span<const llama_token> tokens) { feed(tokens, tokens.size(), nullptr); }

    Session& session() { return session_; }
    int64_t decoded_tokens() const { return decoded_tokens_; }
    int64_t max_cells() const { return max_cells_; }  // most cells the sequence held after any batch
    // FNV-1a of the logical indices of the tokens the cache holds now, as 16 hex digits: two results with the
    // same digest kept the same tokens (runs can be compared for identical eviction decisions); in per-head mode
    // also which heads hold each.
    std::string kept_digest() const;

private:
    Session& session_;
    std::vector<Engine*> engines_;
    int64_t next_pos_;
    int64_t decoded_tokens_ = 0;
    int64_t max_cells_ = 0;
};

llama_token argmax(const float* logits, int32_t n_vocab);
// -log softmax(logits)[target]
double negative_log_likelihood(const float* logits, int32_t n_vocab, llama_token target);

}  // namespace kvp::bench
