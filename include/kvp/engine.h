// The engine: sits in llama.cpp's decode path for one sequence of one llama_context. It captures each new token's
// post-RoPE K and V through the eval callback, scores the token once, records it in the ledger, and evicts cells
// with llama_memory_seq_rm so that the cells in use never exceed the budget.
//
// The caller (kvp_cpp.Llama) drives it around every llama_decode:
//     first_pos = engine.begin_batch(n_logical, n);   // evicts / compacts as needed
//     llama_decode(batch with positions first_pos ..) // the callback scores the tokens
//     engine.end_batch();                             // or abort_batch() if decode failed
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvp/evictor.h"
#include "kvp/format.h"
#include "kvp/ledger.h"
#include "kvp/policy.h"

struct ggml_tensor;
struct llama_context;
struct llama_model;

namespace kvp {

class GraphScorer;

enum class PositionMode {
    original,  // a token keeps its position forever
    compact,   // positions are shifted down over evicted gaps, lazily, when the next one would pass compact_limit
};
PositionMode position_mode_from_name(const std::string& name);  // throws std::invalid_argument
// Whether the libllama this process loaded is the patched one with per-head eviction (llama_kvp_*).
bool per_head_available();
const char* position_mode_name(PositionMode mode);

// Where a learned policy's MLP runs.
enum class ScoringPath {
    automatic,  // in the graph when the loaded libllama can (the patched one) and has a GPU, else the callback
    callback,   // on the CPU, on K/V copied out of the graph by the eval callback
    graph,      // inside llama.cpp's decode graph, on the layer's backend (llama_kvp_scorer_*; patched library)
};
ScoringPath scoring_path_from_name(const std::string& name);  // auto, callback, graph; throws std::invalid_argument
const char* scoring_path_name(ScoringPath path);

// Per-head mode's default head consensus: chosen on 2K retrieval tasks and confirmed on fresh samples, at 2K and
// 4K (docs/per_head.md, "Head consensus"). With 0 a head drops the tokens only the question will need.
inline constexpr double kDefaultHeadConsensus = 0.9;

// The consensus an engine uses: the requested one, else the default per head and 0 in shared mode.
inline double resolve_head_consensus(std::optional<double> requested, bool per_head) {
    return requested.value_or(per_head ? kDefaultHeadConsensus : 0.0);
}

struct EngineConfig {
    int64_t budget = 0;            // cells this sequence may hold
    Protection protection;         // first n_sink and last n_recent tokens stay
    PositionMode position_mode = PositionMode::compact;
    double evict_fraction = 0.0625;  // a full cache sheds at least this fraction of the budget at once
    HeadCombine combine = HeadCombine::sum_softmax;
    int64_t compact_limit = 0;     // positions stay below this in compact mode; 0 = the model's n_ctx_train
    int64_t evicting_chunk = 0;    // prefill chunk once the cache is full; 0 = budget / 4
    int32_t seq_id = 0;
    // Per-head mode: every (layer, KV head) of the cache evicts its own tokens (llama_kvp_* of the patched
    // llama.cpp, looked up at attach time). Needs position_mode original.
    bool per_head = false;
    // Per-head mode: the share of each head's keep-score that follows all heads' vote (select_victims_per_head);
    // 0 = every head by its own score, 1 = every head by shared mode's ranking. Unset: kDefaultHeadConsensus in
    // per-head mode, 0 in shared mode; the engine's config() holds the resolved value.
    std::optional<double> head_consensus;
    ScoringPath scoring = ScoringPath::automatic;
    // Word: the sub-word tokens of a word are ranked by the word's best score, so they stay or leave together;
    // begin_batch then needs the batch's token ids.
    EvictionUnit eviction_unit = EvictionUnit::token;
    // > 0: what the ranking's confident picks leave of the budget is an unbroken stretch of the oldest unprotected
    // tokens (select_victims); shared mode with a softmax head combination only.
    double stretch = 0.0;
};

struct EngineStats {
    int64_t cells_used = 0;
    int64_t budget = 0;
    int64_t tokens_seen = 0;
    int64_t tokens_evicted = 0;
    int64_t eviction_rounds = 0;
    int64_t compactions = 0;
    int64_t seq_add_calls = 0;
    int64_t seq_rm_calls = 0;
    int64_t captured_tensors = 0;
    int64_t policy_state_bytes = 0;  // host copies a policy keeps (e.g. cached keys for attention-based ones)
    int64_t next_position = 0;
    double callback_seconds = 0;  // inside the eval callback for captured tensors (copy + score + bookkeeping)
    double copy_seconds = 0;      // copying K/V out of the graph
    double score_seconds = 0;     // running the policy on captured K/V
    double evict_seconds = 0;     // choosing victims, seq_rm and compaction
};

// What a GGUF model is, as far as a policy is concerned.
ModelIdentity model_identity(const llama_model* model);

class Engine {
public:
    Engine(const llama_model* model, std::unique_ptr<EvictionPolicy> policy, const EngineConfig& config);
    ~Engine();
    Engine(const Engine&) = delete;
    Engine& operator=(const Engine&) = delete;

    // The ggml_backend_sched_eval_callback to put in llama_context_params.cb_eval, with `this` as user data.
    // Null when the policy needs no capture (then no callback is installed and decoding runs at full speed).
    static bool eval_callback(ggml_tensor* tensor, bool ask, void* user_data);
    bool needs_callback() const { return !capture_layer_.empty(); }
    // Whether the policy's scores come from llama.cpp's decode graph (decided at construction).
    bool scores_in_graph() const { return graph_scorer_ != nullptr; }

    // Binds the engine to the context it sits in (created with the callback above). Clears the sequence.
    void attach(llama_context* ctx);
    void detach() { ctx_ = nullptr; }
    bool attached() const { return ctx_ != nullptr; }

    const EngineConfig& config() const { return config_; }
    const EvictionPolicy& policy() const { return *policy_; }
    const ModelIdentity& identity() const { return identity_; }
    const Ledger& ledger() const { return ledger_; }
    int64_t logical_length() const { return next_logical_; }

    // The most tokens one llama_decode may carry once the cache is full: the budget less the protected tokens.
    int64_t max_batch() const;

    // How many of `remaining` tokens the next llama_decode should carry. While they fit without eviction this is
    // min(n_batch, remaining), the split llama-cpp-python uses; once eviction is needed, chunks are capped at
    // evicting_chunk so that each round chooses among most of the cache, not only the few unprotected tokens
    // that a budget-sized chunk would leave.
    int64_t next_batch_size(int64_t remaining, int64_t n_batch) const;

    // Makes room for n new tokens whose logical indices start at logical_length(), then records them.
    // Returns the cache position of the first one. `tokens` (n vocabulary ids) is required with word-level
    // eviction and checked against the vocabulary; it is not used otherwise.
    int64_t begin_batch(int n, const int32_t* tokens = nullptr);
    void end_batch();
    void abort_batch();

    // The oneshot protocol: evicts down to `budget` cells at once (the policy ranks every cached token), and
    // makes `budget` the engine's budget from then on. Returns the number of tokens evicted.
    int64_t compress(int64_t budget);
    // Changes the budget without evicting: at least the cells in use (throws otherwise; see compress). The
    // oneshot protocol raises it after compress so that the question and the answer are appended to the
    // compressed cache without further eviction, as in kvpress and the KV Policy paper.
    void set_budget(int64_t budget);

    // Forgets the tokens with logical index >= n_logical, if the cache still holds every token before it.
    // Returns false, changing nothing, if tokens of that prefix were evicted (the caller must re-prefill).
    bool truncate(int64_t n_logical);
    // Forgets the tokens with logical index >= n_logical and keeps whatever the cache holds of those before it (a
    // conversation cut back to an earlier turn). Returns false, changing nothing, only in per-head mode when the
    // heads hold different numbers of the forgotten tokens (llama.cpp cannot remove them per head).
    bool forget_from(int64_t n_logical);
    // Forgets everything and clears the sequence's cells.
    void reset();

    EngineStats stats() const;

    // Ledger + counters, for save_state/load_state. restore() expects the KV cells to be restored separately; it
    // checks the whole image before it changes anything. check_image() throws exactly what restore() would for
    // the image (std::invalid_argument) and changes nothing: load_state validates with it before touching llama.cpp.
    std::vector<uint8_t> save() const;
    void restore(const uint8_t* data, size_t size);
    void check_image(const uint8_t* data, size_t size) const;

private:
    struct LayerCapture {
        std::vector<uint8_t> k, v, q;  // raw copies of the captured tensors (grow to the largest ubatch once)
        HeadTokenView k_view, v_view;
        bool have_k = false, have_v = false;
        int64_t rows_done = 0;    // tokens of the pending batch whose K and V were scored
        int64_t q_rows_done = 0;  // tokens of the pending batch whose queries were observed
    };
    enum CaptureFlags : uint8_t { kCaptureKV = 1, kCaptureQ = 2 };

    bool wants(const ggml_tensor* t, char* kind, int* layer) const;
    void on_tensor(const ggml_tensor* t, char kind, int layer);
    void evict(size_t n_evict);
    // What the evictor ranks: the ledger after the policy's refresh_scores, plus its recency terms if it has any.
    const Ledger& ranking_ledger();
    void compact();
    void remove_cells(const std::vector<int64_t>& sorted_positions);
    void discard_from(size_t ledger_index);
    void forget_entries(size_t first, size_t last);
    void require_attached() const;
    // Cells each head uses (per-head mode: the same for every head); the ledger size in shared mode.
    int64_t cells_used() const;
    void evict_per_head(size_t n_evict);
    std::vector<int> per_head_columns(llama_context* ctx, int n_cache_layers, int n_head_kv) const;
    void check_budget(int64_t budget, const char* action) const;
    // head_pos: per-head mode, the cells' positions of every (layer, KV head), [layer][head][cell]
    Ledger parse_image(const uint8_t* data, size_t size, int64_t* next_logical, std::vector<int32_t>* head_pos) const;
    std::string store_graph_scores();
    // Word-level eviction: the word the token at logical index `logical` belongs to, from the ledger's last entry.
    int64_t word_of(int64_t logical, int32_t token) const;

    EngineConfig config_;
    ModelIdentity identity_;
    std::unique_ptr<EvictionPolicy> policy_;
    llama_context* ctx_ = nullptr;
    // per-head mode: the ledger score column of each head of the per-head cache (empty: a one-column policy)
    std::vector<int> head_columns_;
    // llama_kvp_evict of the patched llama.cpp (per-head mode), found with dlsym on the loaded libllama
    int32_t (*kvp_evict_)(llama_context*, int32_t, const int32_t*) = nullptr;
    int32_t (*kvp_head_pos_)(const llama_context*, int32_t, int32_t, int32_t*, int32_t) = nullptr;
    int32_t (*kvp_set_head_pos_)(llama_context*, int32_t, int32_t, const int32_t*, int32_t) = nullptr;
    // the policy's MLP when llama.cpp runs it in the graph (ScoringPath)
    std::unique_ptr<GraphScorer> graph_scorer_;
    Ledger ledger_;
    Ledger ranking_;  // the ledger plus the policy's recency terms, rebuilt for every eviction round
    // word-level eviction: per vocabulary id, whether its text starts and ends with a letter or digit (bits)
    std::vector<uint8_t> piece_edges_;
    std::vector<uint8_t> capture_layer_;    // per model layer: CaptureFlags; empty if nothing is captured
    uint32_t n_head_ = 0;                   // query heads
    std::vector<LayerCapture> captures_;    // per model layer
    int64_t next_logical_ = 0;
    size_t pending_begin_ = 0;
    int64_t pending_n_ = 0;
    bool in_batch_ = false;
    std::string capture_error_;
    EngineStats stats_;
};

}  // namespace kvp
