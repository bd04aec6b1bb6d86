#include "kvp/engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include <dlfcn.h>

#include "graph_scorer.h"
#include "llama_symbol.h"
#include "ggml-backend.h"
#include "ggml.h"
#include "llama.h"

namespace kvp {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
}

// Word-level eviction: a token continues the previous token's word when its text starts with a word character and
// the previous one's ends with one (no space or punctuation between them). Bytes >= 0x80 are parts of non-ASCII
// letters in UTF-8.
constexpr uint8_t kPieceContinuesWord = 1, kPieceEndsInWord = 2;
// a longer run without a break (a base64 blob, a long number) is cut into words of at most this many tokens
constexpr int64_t kMaxWordTokens = 16;

bool is_word_byte(unsigned char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c >= 0x80;
}

std::vector<uint8_t> piece_edges(const llama_model* model) {
    const llama_vocab* vocab = llama_model_get_vocab(model);
    const int32_t n_vocab = llama_vocab_n_tokens(vocab);
    std::vector<uint8_t> edges(size_t(std::max(0, n_vocab)), 0);
    std::vector<char> piece(256);
    for (int32_t t = 0; t < n_vocab; ++t) {
        int32_t n = llama_token_to_piece(vocab, t, piece.data(), int32_t(piece.size()), 0, false);
        if (n < 0) {
            piece.resize(size_t(-n));
            n = llama_token_to_piece(vocab, t, piece.data(), int32_t(piece.size()), 0, false);
        }
        if (n <= 0) continue;  // control tokens have no text: they stand alone
        edges[size_t(t)] = uint8_t((is_word_byte(uint8_t(piece[0])) ? kPieceContinuesWord : 0) |
                                   (is_word_byte(uint8_t(piece[size_t(n) - 1])) ? kPieceEndsInWord : 0));
    }
    return edges;
}

std::string model_meta(const llama_model* model, const std::string& key) {
    char buf[256];
    const int32_t n = llama_model_meta_val_str(model, key.c_str(), buf, sizeof buf);
    return n < 0 ? std::string() : std::string(buf);
}

uint32_t meta_uint_or(const llama_model* model, const std::string& key, uint32_t fallback) {
    const std::string value = model_meta(model, key);
    if (value.empty()) return fallback;
    try {
        return uint32_t(std::stoul(value));
    } catch (const std::exception&) {
        return fallback;
    }
}

// "Kcur-12" -> 12; -1 for anything else ("Kcur-12 (view)", "Kcur-x").
int parse_layer_suffix(const char* digits) {
    if (*digits == '\0') return -1;
    int layer = 0;
    for (const char* c = digits; *c; ++c) {
        if (*c < '0' || *c > '9' || layer > 100000) return -1;
        layer = layer * 10 + (*c - '0');
    }
    return layer;
}

}  // namespace

void* kvp_symbol(const char* name) {
    void* lib = dlopen("libllama.so.0", RTLD_LAZY | RTLD_NOLOAD);
    void* fn = lib ? dlsym(lib, name) : nullptr;
    if (lib) dlclose(lib);  // only drops the reference NOLOAD took
    return fn;
}

bool per_head_available() { return kvp_symbol("llama_kvp_evict") != nullptr; }

ScoringPath scoring_path_from_name(const std::string& name) {
    if (name == "auto") return ScoringPath::automatic;
    if (name == "callback") return ScoringPath::callback;
    if (name == "graph") return ScoringPath::graph;
    throw std::invalid_argument("unknown scoring path '" + name + "' (auto, callback, graph)");
}

const char* scoring_path_name(ScoringPath path) {
    switch (path) {
        case ScoringPath::callback: return "callback";
        case ScoringPath::graph: return "graph";
        default: return "auto";
    }
}

PositionMode position_mode_from_name(const std::string& name) {
    if (name == "original") return PositionMode::original;
    if (name == "compact") return PositionMode::compact;
    throw std::invalid_argument("unknown position mode '" + name + "' (original, compact)");
}

const char* position_mode_name(PositionMode mode) {
    return mode == PositionMode::original ? "original" : "compact";
}

ModelIdentity model_identity(const llama_model* model) {
    if (llama_model_n_layer(model) <= 0)
        throw std::invalid_argument("the model has no layers (loaded with vocab_only?); a kv_policy needs the weights");
    ModelIdentity id;
    id.arch = model_meta(model, "general.architecture");
    id.n_layer = uint32_t(llama_model_n_layer(model));
    id.n_head_kv = uint32_t(llama_model_n_head_kv(model));
    const uint32_t n_head = uint32_t(std::max(1, llama_model_n_head(model)));
    const uint32_t head_dim = uint32_t(llama_model_n_embd(model)) / n_head;
    id.head_dim_k = meta_uint_or(model, id.arch + ".attention.key_length", head_dim);
    id.head_dim_v = meta_uint_or(model, id.arch + ".attention.value_length", head_dim);
    id.n_ctx_train = uint32_t(llama_model_n_ctx_train(model));
    return id;
}

Engine::Engine(const llama_model* model, std::unique_ptr<EvictionPolicy> policy, const EngineConfig& config)
    : config_(config), identity_(model_identity(model)), policy_(std::move(policy)) {
    if (!policy_) throw std::invalid_argument("the engine needs a policy");
    Protection& protection = config_.protection;
    if (protection.n_recent < 1)
        throw std::invalid_argument("kv_recent must be >= 1: the newest token can never be evicted");
    // Sliding-window layers (Gemma 3) attend to the last n_swa tokens; evicting one of those would take it from
    // them too, so the window is always part of the protected recent tokens.
    const uint32_t n_swa = uint32_t(std::max(0, llama_model_n_swa(model)));
    std::string window_note;
    if (n_swa > protection.n_recent) {
        protection.n_recent = n_swa;
        window_note = " (kv_recent is raised to the model's sliding window, " + std::to_string(n_swa) + " tokens)";
    }
    const int64_t min_budget = int64_t(protection.n_sink) + int64_t(protection.n_recent) + 1;  // no u32 wrap
    if (config_.budget < min_budget)
        throw std::invalid_argument("kv_budget " + std::to_string(config_.budget) + " must be at least kv_sink + kv_recent + 1 = " +
                                    std::to_string(min_budget) + window_note);
    if (!(config_.evict_fraction >= 0.0 && config_.evict_fraction <= 1.0))
        throw std::invalid_argument("kv_evict_fraction must be in [0, 1]");
    const double consensus = resolve_head_consensus(config_.head_consensus, config_.per_head);
    if (!(consensus >= 0.0 && consensus <= 1.0))
        throw std::invalid_argument("kv_head_consensus must be in [0, 1], got " + std::to_string(consensus));
    if (consensus != 0.0 && !config_.per_head)
        throw std::invalid_argument("kv_head_consensus applies to kv_mode='per_head' only");
    config_.head_consensus = consensus;
    check_stretch(config_.stretch, config_.combine);
    if (config_.stretch != 0.0 && config_.per_head)
        throw std::invalid_argument("the stretch applies to shared mode only");
    if (config_.per_head && config_.position_mode != PositionMode::original)
        throw std::invalid_argument("kv_mode='per_head' keeps original positions: use kv_position_mode='original'");
    if (config_.compact_limit <= 0) config_.compact_limit = identity_.n_ctx_train;
    if (config_.evicting_chunk <= 0) config_.evicting_chunk = std::max<int64_t>(1, config_.budget / 4);
    if (config_.position_mode == PositionMode::compact && config_.budget > config_.compact_limit)
        throw std::invalid_argument("kv_budget " + std::to_string(config_.budget) +
                                    " exceeds the compact position limit " + std::to_string(config_.compact_limit) +
                                    " (the model's n_ctx_train); use a smaller budget or kv_position_mode='original'");

    ledger_ = Ledger(policy_->n_score_columns());
    if (config_.eviction_unit == EvictionUnit::word) {
        ledger_.set_word_groups(true);
        piece_edges_ = piece_edges(model);
    }
    n_head_ = uint32_t(std::max(0, llama_model_n_head(model)));
    capture_layer_.assign(identity_.n_layer, 0);
    bool any = false;
    auto request = [&](const std::vector<int>& layers, uint8_t flag) {
        for (int layer : layers) {
            if (layer < 0 || uint32_t(layer) >= identity_.n_layer)
                throw std::invalid_argument("policy asks for layer " + std::to_string(layer) + " of a " +
                                            std::to_string(identity_.n_layer) + "-layer model");
            capture_layer_[layer] |= flag;
            any = true;
        }
    };
    const Policy* mlp = policy_->graph_scorer();
    if (config_.scoring == ScoringPath::graph && !mlp)
        throw std::invalid_argument("kv_scoring='graph' runs a learned policy's MLP in llama.cpp's graph; '" +
                                    policy_->name() + "' is not one");
    // the patched llama.cpp scores in the plain KV cache's attention only: not Gemma 3's sliding-window cache
    const bool plain_cache = llama_model_n_swa(model) <= 0;
    if (config_.scoring == ScoringPath::graph && !plain_cache)
        throw std::invalid_argument("kv_scoring='graph' needs a model without sliding-window layers");
    // "auto" scores in the graph only where llama.cpp has a GPU: on the CPU the callback's syncs cost nothing and
    // the scorer's graph nodes do (decode 0.88x against 0.96x of plain llama.cpp, benchmarks/results/engine_graph.md)
    const bool graph_pays_off = plain_cache && llama_supports_gpu_offload() && GraphScorer::available();
    if (mlp && (config_.scoring == ScoringPath::graph ||
                (config_.scoring == ScoringPath::automatic && graph_pays_off)))
        graph_scorer_ = std::make_unique<GraphScorer>(*mlp);  // throws if the loaded libllama lacks it
    if (!graph_scorer_) request(policy_->capture_layers(), kCaptureKV);
    request(policy_->query_layers(), kCaptureQ);
    if (!any) capture_layer_.clear();
    captures_.resize(identity_.n_layer);
    stats_.budget = config_.budget;
}

Engine::~Engine() = default;

void Engine::require_attached() const {
    if (!ctx_) throw std::logic_error("the engine is not attached to a llama_context (closed?)");
}

void Engine::attach(llama_context* ctx) {
    if (!ctx) throw std::invalid_argument("null llama_context");
    if (int64_t(llama_n_ctx(ctx)) < config_.budget)
        throw std::invalid_argument("the context has " + std::to_string(llama_n_ctx(ctx)) + " cells, fewer than kv_budget " +
                                    std::to_string(config_.budget));
    if (config_.position_mode == PositionMode::compact && !llama_memory_can_shift(llama_get_memory(ctx)))
        throw std::invalid_argument("this model's KV cache cannot shift positions; use kv_position_mode='original'");
    int n_heads = 0;
    if (config_.per_head) {
        auto enable = reinterpret_cast<int32_t (*)(llama_context*)>(kvp_symbol("llama_kvp_enable"));
        auto n_layer = reinterpret_cast<int32_t (*)(const llama_context*)>(kvp_symbol("llama_kvp_n_layer"));
        auto n_head_kv = reinterpret_cast<int32_t (*)(const llama_context*)>(kvp_symbol("llama_kvp_n_head_kv"));
        kvp_evict_ = reinterpret_cast<int32_t (*)(llama_context*, int32_t, const int32_t*)>(kvp_symbol("llama_kvp_evict"));
        kvp_head_pos_ = reinterpret_cast<decltype(kvp_head_pos_)>(kvp_symbol("llama_kvp_head_pos"));
        kvp_set_head_pos_ = reinterpret_cast<decltype(kvp_set_head_pos_)>(kvp_symbol("llama_kvp_set_head_pos"));
        if (!enable || !n_layer || !n_head_kv || !kvp_evict_)
            throw std::runtime_error("kv_mode='per_head' needs the patched llama.cpp (llama_kvp_*), and this process "
                                     "loaded the stock one");
        if (!kvp_head_pos_)
            throw std::runtime_error("this patched llama.cpp lacks llama_kvp_head_pos, which per-head mode needs to "
                                     "save its state: rebuild it (python -m kvp_cpp.llama_build)");
        if (enable(ctx) != 0)
            throw std::invalid_argument("this model's KV cache cannot evict per head (one sequence, no ALiBi or "
                                        "M-RoPE); see llama.cpp's log");
        n_heads = n_layer(ctx) * n_head_kv(ctx);
        head_columns_ = per_head_columns(ctx, n_layer(ctx), n_head_kv(ctx));
    }
    if (graph_scorer_) graph_scorer_->upload(ctx);
    ctx_ = ctx;
    reset();
    ledger_.set_holders(n_heads);
}

std::vector<int> Engine::per_head_columns(llama_context* ctx, int n_cache_layers, int n_head_kv) const {
    if (ledger_.n_columns() == 1) return {};  // every head ranks by the one score
    // the model layer of each cache layer: on a model with sliding-window layers, the per-head cache holds the
    // full-attention layers only
    auto layer_of = reinterpret_cast<int32_t (*)(const llama_context*, int32_t)>(kvp_symbol("llama_kvp_layer"));
    const bool unknown = !layer_of && n_cache_layers != int(identity_.n_layer);  // without it: every layer
    std::vector<int> cache_layers(static_cast<size_t>(n_cache_layers));
    for (int i = 0; i < n_cache_layers; ++i) {
        cache_layers[size_t(i)] = layer_of ? layer_of(ctx, i) : i;
        if (cache_layers[size_t(i)] < 0 || unknown)
            throw std::runtime_error("cannot tell which model layer the per-head cache's layer " + std::to_string(i) +
                                     " is: rebuild the patched llama.cpp (python -m kvp_cpp.llama_build)");
    }
    const std::vector<int> scored = per_head_score_layers(*policy_, identity_);
    if (scored.empty() || n_head_kv != int(identity_.n_head_kv))
        throw std::invalid_argument("kv_mode='per_head' needs a policy with one score per (layer, KV head) or one per "
                                    "token; '" + policy_->name() + "' has " + std::to_string(ledger_.n_columns()) +
                                    " score columns");
    std::vector<int> columns;
    for (int layer : cache_layers) {
        const auto it = std::find(scored.begin(), scored.end(), layer);
        if (it == scored.end())
            throw std::invalid_argument("kv_mode='per_head' evicts from every head of layer " + std::to_string(layer) +
                                        ", and the policy '" + policy_->name() + "' does not score that layer");
        for (int h = 0; h < n_head_kv; ++h) columns.push_back(int(it - scored.begin()) * n_head_kv + h);
    }
    return columns;
}

int64_t Engine::cells_used() const {
    return int64_t(ledger_.n_holders() ? ledger_.held_count(0, 0, ledger_.size()) : ledger_.size());
}

int64_t Engine::max_batch() const {
    return config_.budget - int64_t(config_.protection.n_sink) - int64_t(config_.protection.n_recent);
}

int64_t Engine::next_batch_size(int64_t remaining, int64_t n_batch) const {
    const int64_t natural = std::min(std::max<int64_t>(n_batch, 1), remaining);
    if (cells_used() + natural <= config_.budget) return natural;
    return std::min({natural, config_.evicting_chunk, max_batch()});
}

// --- the eval callback ------------------------------------------------------------------------------------------

bool Engine::wants(const ggml_tensor* t, char* kind, int* layer) const {
    const char* name = t->name;
    const char c = name[0];
    if ((c != 'K' && c != 'V' && c != 'Q') || std::strncmp(name + 1, "cur-", 4) != 0) return false;
    const int l = parse_layer_suffix(name + 5);
    if (l < 0 || size_t(l) >= capture_layer_.size()) return false;
    if (!(capture_layer_[l] & (c == 'Q' ? kCaptureQ : kCaptureKV))) return false;
    if (t->type != GGML_TYPE_F32 || t->nb[0] != sizeof(float)) return false;
    // Kcur-<l> and Qcur-<l> name the projection, its reshape and the RoPE; the post-RoPE one is the ROPE node.
    // Vcur-<l> is the projection and its reshape to [head_dim, n_head_kv, tokens].
    switch (c) {
        case 'K':
            if (t->op != GGML_OP_ROPE || t->ne[0] != identity_.head_dim_k || t->ne[1] != identity_.n_head_kv) return false;
            break;
        case 'Q':
            if (t->op != GGML_OP_ROPE || t->ne[0] != identity_.head_dim_k || t->ne[1] != n_head_) return false;
            break;
        default:
            if (t->op != GGML_OP_RESHAPE || t->ne[0] != identity_.head_dim_v || t->ne[1] != identity_.n_head_kv) return false;
    }
    *kind = c;
    *layer = l;
    return true;
}

bool Engine::eval_callback(ggml_tensor* t, bool ask, void* user_data) {
    auto* engine = static_cast<Engine*>(user_data);
    char kind;
    int layer;
    if (!engine->wants(t, &kind, &layer)) return !ask;  // not ours: don't ask for it, keep computing
    if (ask) return true;
    try {
        engine->on_tensor(t, kind, layer);
    } catch (const std::exception& e) {
        // Never throw through ggml's C frames; end_batch() reports it.
        if (engine->capture_error_.empty()) engine->capture_error_ = e.what();
    }
    return true;
}

void Engine::on_tensor(const ggml_tensor* t, char kind, int layer) {
    const auto start = Clock::now();
    if (!in_batch_) throw std::logic_error("K/V captured outside begin_batch/end_batch (decode called directly?)");
    LayerCapture& cap = captures_[layer];
    std::vector<uint8_t>& buffer = kind == 'K' ? cap.k : kind == 'V' ? cap.v : cap.q;
    const size_t nbytes = ggml_nbytes(t);
    if (buffer.size() < nbytes) buffer.resize(nbytes);
    const auto copy_start = Clock::now();
    if (t->buffer && ggml_backend_buffer_is_host(t->buffer))
        std::memcpy(buffer.data(), t->data, nbytes);
    else
        ggml_backend_tensor_get(t, buffer.data(), 0, nbytes);
    stats_.copy_seconds += seconds_since(copy_start);
    const HeadTokenView view{reinterpret_cast<const float*>(buffer.data()), t->ne[0], t->ne[1], t->ne[2],
                             size_t(t->nb[1]), size_t(t->nb[2])};
    ++stats_.captured_tensors;

    if (kind == 'Q') {
        if (cap.q_rows_done + view.n_token > pending_n_)
            throw std::runtime_error("layer " + std::to_string(layer) + " saw more queries than tokens submitted");
        const size_t row0 = pending_begin_ + size_t(cap.q_rows_done);
        const auto score_start = Clock::now();
        policy_->observe_queries(layer, view, ledger_.original_pos_data() + row0, ledger_.logical_data() + row0);
        stats_.score_seconds += seconds_since(score_start);
        cap.q_rows_done += view.n_token;
        stats_.callback_seconds += seconds_since(start);
        return;
    }
    (kind == 'K' ? cap.k_view : cap.v_view) = view;
    (kind == 'K' ? cap.have_k : cap.have_v) = true;

    if (cap.have_k && cap.have_v) {
        const int64_t n = cap.k_view.n_token;
        if (cap.v_view.n_token != n) throw std::runtime_error("layer " + std::to_string(layer) + ": K and V disagree on the ubatch size");
        if (cap.rows_done + n > pending_n_)
            throw std::runtime_error("layer " + std::to_string(layer) + " saw more tokens than were submitted");
        const size_t row0 = pending_begin_ + size_t(cap.rows_done);
        const auto score_start = Clock::now();
        policy_->score_kv(layer, cap.k_view, cap.v_view, ledger_.original_pos_data() + row0,
                          ledger_.logical_data() + row0, ledger_.scores(row0), size_t(ledger_.n_columns()));
        stats_.score_seconds += seconds_since(score_start);
        cap.rows_done += n;
        cap.have_k = cap.have_v = false;
    }
    stats_.callback_seconds += seconds_since(start);
}

// --- batches ------------------------------------------------------------------------------------------------------

int64_t Engine::word_of(int64_t logical, int32_t token) const {
    if (ledger_.empty()) return logical;
    const size_t last = ledger_.size() - 1;
    const int32_t previous = ledger_.token(last);
    // the previous token must still be cached (else its word is gone) and the pieces must touch
    const bool joins = ledger_.logical(last) == logical - 1 && previous >= 0 &&
                       (piece_edges_[size_t(previous)] & kPieceEndsInWord) &&
                       (piece_edges_[size_t(token)] & kPieceContinuesWord) &&
                       logical - ledger_.word(last) < kMaxWordTokens;
    return joins ? ledger_.word(last) : logical;
}

int64_t Engine::begin_batch(int n, const int32_t* tokens) {
    require_attached();
    if (in_batch_) throw std::logic_error("begin_batch called twice without end_batch/abort_batch");
    if (n <= 0 || n > config_.budget)
        throw std::invalid_argument("a batch must hold 1.." + std::to_string(config_.budget) + " tokens, got " + std::to_string(n));
    const bool words = config_.eviction_unit == EvictionUnit::word;
    if (words && !tokens) throw std::invalid_argument("word-level eviction needs the batch's token ids");
    if (words)
        for (int i = 0; i < n; ++i)
            if (tokens[i] < 0 || size_t(tokens[i]) >= piece_edges_.size())
                throw std::invalid_argument("token id " + std::to_string(tokens[i]) + " is outside the model's vocabulary (" +
                                            std::to_string(piece_edges_.size()) + " tokens)");

    const size_t used = size_t(cells_used());
    if (int64_t(used) + n > config_.budget) {
        const size_t need = used + n - size_t(config_.budget);
        const size_t entries = ledger_.size();
        const size_t first_candidate = ledger_.lower_bound(config_.protection.n_sink);
        const size_t end_candidate = entries > config_.protection.n_recent ? entries - config_.protection.n_recent : 0;
        // per-head mode: every head holds the same number of candidates (sinks and recent tokens are in all)
        const size_t n_candidates = ledger_.held_count(0, first_candidate, end_candidate);
        if (need > n_candidates)
            throw std::invalid_argument("a batch of " + std::to_string(n) + " tokens needs " + std::to_string(need) +
                                        " cells but only " + std::to_string(n_candidates) +
                                        " cached tokens are unprotected (use next_batch_size())");
        const size_t batch = size_t(std::ceil(config_.evict_fraction * double(config_.budget)));
        evict(std::min(std::max(need, batch), n_candidates));
    }

    int64_t first_pos = ledger_.empty() ? 0 : ledger_.cache_pos(ledger_.size() - 1) + 1;
    if (config_.position_mode == PositionMode::compact && first_pos + n > config_.compact_limit) {
        compact();
        first_pos = int64_t(ledger_.size());
    }

    pending_begin_ = ledger_.size();
    pending_n_ = n;
    for (int i = 0; i < n; ++i) {
        const int64_t logical = next_logical_ + i;
        if (words) ledger_.append(logical, logical, first_pos + i, word_of(logical, tokens[i]), tokens[i]);
        else ledger_.append(logical, logical, first_pos + i);
    }
    policy_->score_positions(ledger_.logical_data() + pending_begin_, ledger_.original_pos_data() + pending_begin_, n,
                             ledger_.scores(pending_begin_), size_t(ledger_.n_columns()));
    for (LayerCapture& cap : captures_) {
        cap.rows_done = cap.q_rows_done = 0;
        cap.have_k = cap.have_v = false;
    }
    capture_error_.clear();
    if (graph_scorer_) graph_scorer_->set_pos_offset(ctx_, next_logical_ - first_pos);
    in_batch_ = true;
    return first_pos;
}

std::string Engine::store_graph_scores() {
    const auto start = Clock::now();
    if (!graph_scorer_->current(ctx_))
        return "another policy's scorer was uploaded to this llama_context since this engine attached";
    for (int layer : graph_scorer_->layers()) {
        int64_t n = 0;
        const float* scores = graph_scorer_->scores(ctx_, layer, &n);
        if (!scores || n != pending_n_)
            return "layer " + std::to_string(layer) + ": llama.cpp scored " + std::to_string(n) + " of " +
                   std::to_string(pending_n_) + " tokens in the graph (was the batch decoded with llama_decode?)";
        policy_->store_graph_scores(layer, scores, n, ledger_.scores(pending_begin_), size_t(ledger_.n_columns()));
    }
    stats_.score_seconds += seconds_since(start);
    return "";
}

void Engine::end_batch() {
    if (!in_batch_) throw std::logic_error("end_batch without begin_batch");
    std::string error = capture_error_;
    if (error.empty() && graph_scorer_) error = store_graph_scores();
    for (size_t layer = 0; error.empty() && layer < capture_layer_.size(); ++layer) {
        const LayerCapture& cap = captures_[layer];
        const bool kv_short = (capture_layer_[layer] & kCaptureKV) && cap.rows_done != pending_n_;
        const bool q_short = (capture_layer_[layer] & kCaptureQ) && cap.q_rows_done != pending_n_;
        if (kv_short || q_short)
            error = "layer " + std::to_string(layer) + ": captured " + (kv_short ? "K/V" : "Q") + " for " +
                    std::to_string(kv_short ? cap.rows_done : cap.q_rows_done) + " of " + std::to_string(pending_n_) +
                    " tokens (is the eval callback installed, and does this architecture name its nodes "
                    "Qcur/Kcur/Vcur-<layer>?)";
    }
    if (!error.empty()) {
        abort_batch();
        throw std::runtime_error("kvp capture failed: " + error);
    }
    in_batch_ = false;
    next_logical_ += pending_n_;
    stats_.tokens_seen += pending_n_;
}

void Engine::abort_batch() {
    if (!in_batch_) return;
    in_batch_ = false;
    discard_from(pending_begin_);
}

// --- eviction -----------------------------------------------------------------------------------------------------

void Engine::remove_cells(const std::vector<int64_t>& sorted_positions) {
    llama_memory_t mem = llama_get_memory(ctx_);
    for (size_t i = 0; i < sorted_positions.size();) {
        size_t j = i + 1;
        while (j < sorted_positions.size() && sorted_positions[j] == sorted_positions[j - 1] + 1) ++j;
        llama_memory_seq_rm(mem, config_.seq_id, llama_pos(sorted_positions[i]), llama_pos(sorted_positions[j - 1] + 1));
        ++stats_.seq_rm_calls;
        i = j;
    }
}

const Ledger& Engine::ranking_ledger() {
    policy_->refresh_scores(ledger_);
    const bool words = config_.eviction_unit == EvictionUnit::word;
    if (!policy_->has_recency_terms() && !words) return ledger_;
    ranking_ = ledger_;
    if (policy_->has_recency_terms()) policy_->add_recency_terms(ranking_, next_logical_);  // original positions are logical indices
    if (words) share_word_scores(ranking_);
    return ranking_;
}

void Engine::evict(size_t n_evict) {
    if (ledger_.n_holders()) return evict_per_head(n_evict);
    const auto start = Clock::now();
    const std::vector<size_t> victims =
        select_victims(ranking_ledger(), config_.protection, n_evict, config_.combine, config_.stretch);
    std::vector<int64_t> positions, logical;
    positions.reserve(victims.size());
    logical.reserve(victims.size());
    for (size_t i : victims) {
        positions.push_back(ledger_.cache_pos(i));
        logical.push_back(ledger_.logical(i));
    }
    remove_cells(positions);
    ledger_.remove(victims);
    policy_->forget(logical);
    stats_.tokens_evicted += int64_t(victims.size());
    ++stats_.eviction_rounds;
    stats_.evict_seconds += seconds_since(start);
}

void Engine::evict_per_head(size_t n_evict) {
    const auto start = Clock::now();
    const std::vector<std::vector<size_t>> victims =
        select_victims_per_head(ranking_ledger(), config_.protection, n_evict, *config_.head_consensus, head_columns_);
    std::vector<int32_t> positions;
    positions.reserve(victims.size() * n_evict);
    for (const auto& head : victims)
        for (size_t i : head) positions.push_back(int32_t(ledger_.cache_pos(i)));
    const int32_t rc = kvp_evict_(ctx_, int32_t(n_evict), positions.data());
    if (rc != 0) throw std::runtime_error("llama_kvp_evict failed (" + std::to_string(rc) + "); see llama.cpp's log");
    for (size_t h = 0; h < victims.size(); ++h)
        for (size_t i : victims[h]) ledger_.release(i, int(h));
    // entries no head holds any more leave the ledger
    std::vector<size_t> gone;
    std::vector<int64_t> logical;
    for (size_t i = 0; i < ledger_.size(); ++i)
        if (!ledger_.held_by_any(i)) {
            gone.push_back(i);
            logical.push_back(ledger_.logical(i));
        }
    ledger_.remove(gone);
    policy_->forget(logical);
    stats_.tokens_evicted += int64_t(n_evict);  // per head
    ++stats_.eviction_rounds;
    stats_.evict_seconds += seconds_since(start);
}

void Engine::compact() {
    const auto start = Clock::now();
    llama_memory_t mem = llama_get_memory(ctx_);
    // Runs of entries with the same gap below them move down together; earlier runs move first, so a run never
    // lands on cells that are still occupied.
    for (size_t i = 0; i < ledger_.size();) {
        const int64_t delta = ledger_.cache_pos(i) - int64_t(i);
        size_t j = i + 1;
        while (j < ledger_.size() && ledger_.cache_pos(j) - int64_t(j) == delta) ++j;
        if (delta != 0) {
            llama_memory_seq_add(mem, config_.seq_id, llama_pos(ledger_.cache_pos(i)),
                                 llama_pos(ledger_.cache_pos(j - 1) + 1), llama_pos(-delta));
            ++stats_.seq_add_calls;
            for (size_t r = i; r < j; ++r) ledger_.set_cache_pos(r, int64_t(r));
        }
        i = j;
    }
    ++stats_.compactions;
    stats_.evict_seconds += seconds_since(start);
}

void Engine::forget_entries(size_t first, size_t last) {
    if (first >= last) return;
    policy_->forget(std::vector<int64_t>(ledger_.logical_data() + first, ledger_.logical_data() + last));
}

void Engine::discard_from(size_t ledger_index) {
    if (ledger_index >= ledger_.size()) return;
    if (ctx_) {
        if (!llama_memory_seq_rm(llama_get_memory(ctx_), config_.seq_id, llama_pos(ledger_.cache_pos(ledger_index)), -1))
            throw std::runtime_error("llama.cpp refused to remove the cells from position " +
                                     std::to_string(ledger_.cache_pos(ledger_index)) + " on");
        ++stats_.seq_rm_calls;
    }
    forget_entries(ledger_index, ledger_.size());
    ledger_.truncate(ledger_index);
}

int64_t Engine::compress(int64_t budget) {
    require_attached();
    if (in_batch_) throw std::logic_error("compress during a batch");
    check_budget(budget, "compress to");
    const int64_t excess = cells_used() - budget;
    if (excess > 0) evict(size_t(excess));
    set_budget(budget);
    return std::max<int64_t>(excess, 0);
}

void Engine::set_budget(int64_t budget) {
    require_attached();
    if (in_batch_) throw std::logic_error("set_budget during a batch");
    check_budget(budget, "set the budget to");
    if (budget < cells_used())
        throw std::invalid_argument("cannot set the budget to " + std::to_string(budget) + " cells: the cache holds " +
                                    std::to_string(cells_used()) + " (use compress to evict down to it)");
    config_.budget = budget;
    config_.evicting_chunk = std::max<int64_t>(1, budget / 4);
    stats_.budget = budget;
}

void Engine::check_budget(int64_t budget, const char* action) const {
    const Protection& protection = config_.protection;
    const int64_t min_budget = int64_t(protection.n_sink) + int64_t(protection.n_recent) + 1;
    const std::string what = std::string("cannot ") + action + " " + std::to_string(budget) + " cells: ";
    if (budget < min_budget)
        throw std::invalid_argument(what + "kv_sink + kv_recent + 1 = " + std::to_string(min_budget));
    if (budget > int64_t(llama_n_ctx(ctx_)))
        throw std::invalid_argument(what + "the context has " + std::to_string(llama_n_ctx(ctx_)));
    if (config_.position_mode == PositionMode::compact && budget > config_.compact_limit)
        throw std::invalid_argument(what + "the compact position limit is " + std::to_string(config_.compact_limit));
}

bool Engine::truncate(int64_t n_logical) {
    if (in_batch_) throw std::logic_error("truncate during a batch");
    if (n_logical < 0) n_logical = 0;
    if (n_logical >= next_logical_) return true;
    const size_t index = ledger_.lower_bound(n_logical);
    if (int64_t(index) != n_logical) return false;  // part of the prefix was evicted
    for (int h = 0; h < ledger_.n_holders(); ++h)
        if (ledger_.held_count(h, 0, index) != index) return false;  // ... from some heads
    discard_from(index);
    next_logical_ = n_logical;
    return true;
}

bool Engine::forget_from(int64_t n_logical) {
    if (in_batch_) throw std::logic_error("forget_from during a batch");
    if (n_logical < 0) n_logical = 0;
    if (n_logical >= next_logical_) return true;
    const size_t index = ledger_.lower_bound(n_logical);
    for (int h = 1; h < ledger_.n_holders(); ++h)
        if (ledger_.held_count(h, index, ledger_.size()) != ledger_.held_count(0, index, ledger_.size())) return false;
    discard_from(index);
    next_logical_ = n_logical;
    return true;
}

void Engine::reset() {
    in_batch_ = false;
    forget_entries(0, ledger_.size());
    ledger_.clear();
    next_logical_ = 0;
    if (ctx_) llama_memory_seq_rm(llama_get_memory(ctx_), config_.seq_id, -1, -1);
}

EngineStats Engine::stats() const {
    EngineStats s = stats_;
    s.cells_used = cells_used();
    s.policy_state_bytes = int64_t(policy_->state_bytes());
    s.next_position = ledger_.empty() ? 0 : ledger_.cache_pos(ledger_.size() - 1) + 1;
    return s;
}

// --- state --------------------------------------------------------------------------------------------------------

namespace {
// per-head images: after next_logical, this magic, n_cells and n_heads (u64), then int32 positions [head][cell]
constexpr char kHeadPosMagic[8] = {'K', 'V', 'P', 'H', 'E', 'A', 'D', 'S'};
}  // namespace

std::vector<uint8_t> Engine::save() const {
    if (in_batch_) throw std::logic_error("cannot save state during a batch");
    std::vector<uint8_t> out(sizeof(int64_t));
    std::memcpy(out.data(), &next_logical_, sizeof(int64_t));
    if (ledger_.n_holders()) {
        require_attached();
        const uint64_t n_cells = llama_n_ctx(ctx_), n_heads = uint64_t(ledger_.n_holders());
        std::vector<int32_t> pos(n_cells * n_heads);
        const int n_head_kv = int(identity_.n_head_kv);
        for (uint64_t lh = 0; lh < n_heads; ++lh)
            if (kvp_head_pos_(ctx_, int(lh) / n_head_kv, int(lh) % n_head_kv, pos.data() + lh * n_cells,
                              int32_t(n_cells)) < 0)
                throw std::runtime_error("llama_kvp_head_pos failed; see llama.cpp's log");
        out.insert(out.end(), kHeadPosMagic, kHeadPosMagic + 8);
        const uint64_t sizes[2] = {n_cells, n_heads};
        const auto* bytes = reinterpret_cast<const uint8_t*>(sizes);
        out.insert(out.end(), bytes, bytes + sizeof sizes);
        bytes = reinterpret_cast<const uint8_t*>(pos.data());
        out.insert(out.end(), bytes, bytes + pos.size() * sizeof(int32_t));
    }
    const std::vector<uint8_t> ledger = ledger_.serialize();
    out.insert(out.end(), ledger.begin(), ledger.end());
    return out;
}

Ledger Engine::parse_image(const uint8_t* data, size_t size, int64_t* next_logical,
                           std::vector<int32_t>* head_pos) const {
    if (in_batch_) throw std::logic_error("cannot restore state during a batch");
    if (size < sizeof(int64_t)) throw std::invalid_argument("kvp engine state is truncated");
    std::memcpy(next_logical, data, sizeof(int64_t));
    data += sizeof(int64_t), size -= sizeof(int64_t);
    const bool has_head_pos = size >= 8 && std::memcmp(data, kHeadPosMagic, 8) == 0;
    if (has_head_pos != (ledger_.n_holders() != 0))
        throw std::invalid_argument(has_head_pos ? "kvp engine state was saved in per-head mode (kv_mode='per_head')"
                                                 : "kvp engine state was saved in shared mode, not per head");
    if (has_head_pos) {
        require_attached();
        uint64_t sizes[2];
        if (size < 8 + sizeof sizes) throw std::invalid_argument("kvp engine state is truncated");
        std::memcpy(sizes, data + 8, sizeof sizes);
        const uint64_t n_cells = sizes[0], n_heads = sizes[1];
        if (n_cells != uint64_t(llama_n_ctx(ctx_)) || n_heads != uint64_t(ledger_.n_holders()) ||
            size < 8 + sizeof sizes + n_cells * n_heads * sizeof(int32_t))
            throw std::invalid_argument("kvp engine state was saved for another cache size or head count");
        head_pos->resize(n_cells * n_heads);
        std::memcpy(head_pos->data(), data + 8 + sizeof sizes, head_pos->size() * sizeof(int32_t));
        const size_t skip = 8 + sizeof sizes + head_pos->size() * sizeof(int32_t);
        data += skip, size -= skip;
    }
    Ledger ledger = Ledger::deserialize(data, size);
    if (ledger.n_columns() != ledger_.n_columns())
        throw std::invalid_argument("kvp engine state was saved with another policy (score columns differ)");
    if (ledger.n_holders() != ledger_.n_holders())
        throw std::invalid_argument("kvp engine state was saved with another number of heads");
    if (ledger.word_groups() != ledger_.word_groups())
        throw std::invalid_argument(std::string("kvp engine state was saved with kv_evict_unit='") +
                                    (ledger.word_groups() ? "word" : "token") + "', this one uses '" +
                                    eviction_unit_name(config_.eviction_unit) + "'");
    for (size_t i = 0; i < ledger.size() && ledger.word_groups(); ++i)
        if (ledger.token(i) < -1 || (ledger.token(i) >= 0 && size_t(ledger.token(i)) >= piece_edges_.size()))
            throw std::invalid_argument("kvp engine state holds a token id outside the model's vocabulary");
    bool over_budget = !ledger.n_holders() && int64_t(ledger.size()) > config_.budget;
    for (int h = 0; h < ledger.n_holders(); ++h)
        over_budget |= int64_t(ledger.held_count(h, 0, ledger.size())) > config_.budget;
    if (over_budget) throw std::invalid_argument("kvp engine state holds more tokens than kv_budget");
    if (!ledger.empty() && ledger.logical(ledger.size() - 1) >= *next_logical)
        throw std::invalid_argument("kvp engine state is inconsistent");
    return ledger;
}

void Engine::check_image(const uint8_t* data, size_t size) const {
    int64_t next_logical;
    std::vector<int32_t> head_pos;
    parse_image(data, size, &next_logical, &head_pos);
}

void Engine::restore(const uint8_t* data, size_t size) {
    int64_t next_logical;
    std::vector<int32_t> head_pos;
    Ledger ledger = parse_image(data, size, &next_logical, &head_pos);
    if (ledger.n_holders()) {
        // the KV cells were restored (llama_state_*) but not which position each head holds in them
        if (!kvp_set_head_pos_)
            throw std::runtime_error("restoring a per-head state needs llama_kvp_set_head_pos: rebuild the patched "
                                     "llama.cpp (python -m kvp_cpp.llama_build)");
        const size_t n_cells = llama_n_ctx(ctx_);
        const int n_head_kv = int(identity_.n_head_kv), n_heads = ledger.n_holders();
        // A whole-state load packs the used cells from cell 0, in their saved order, and every head then holds
        // the cell's position (the largest of any head's in it). Move each head's saved positions the same way,
        // and check that the cells came back where this expects them.
        std::vector<int32_t> loaded(n_cells);
        if (kvp_head_pos_(ctx_, 0, 0, loaded.data(), int32_t(n_cells)) < 0)
            throw std::runtime_error("llama_kvp_head_pos failed; see llama.cpp's log");
        std::vector<size_t> used;  // saved cells in use (every head uses the same ones)
        for (size_t c = 0; c < n_cells; ++c)
            if (head_pos[c] >= 0) used.push_back(c);
        std::vector<int32_t> packed(head_pos.size(), -1);
        for (int lh = 0; lh < n_heads; ++lh)
            for (size_t i = 0; i < used.size(); ++i)
                packed[size_t(lh) * n_cells + i] = head_pos[size_t(lh) * n_cells + used[i]];
        for (size_t c = 0; c < n_cells; ++c) {
            int32_t top = -1;
            for (int lh = 0; lh < n_heads; ++lh) top = std::max(top, packed[size_t(lh) * n_cells + c]);
            if (top != loaded[c])
                throw std::invalid_argument("the per-head positions of this state do not match the KV cells it "
                                            "restored (cell " + std::to_string(c) + ")");
        }
        for (int lh = 0; lh < n_heads; ++lh)
            if (kvp_set_head_pos_(ctx_, lh / n_head_kv, lh % n_head_kv, packed.data() + size_t(lh) * n_cells,
                                  int32_t(n_cells)) != 0)
                throw std::invalid_argument("the per-head positions of this state do not fit the KV cache it was "
                                            "loaded with; see llama.cpp's log");
    }
    forget_entries(0, ledger_.size());
    ledger_ = std::move(ledger);
    next_logical_ = next_logical;
}

}  // namespace kvp
