#include "session.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "digest.h"
#include "ggml.h"
#include "kvp/engine.h"

namespace kvp::bench {

// --- model ----------------------------------------------------------------------------------------------------

// The pinned llama.cpp's AMX kernels raise SIGILL when GCC built them; they run only from the extra buffer types,
// so a build that has them loads without those (python/kvp_cpp/_amx.py says why; KVP_CPP_ALLOW_AMX=1 keeps them).
static bool keep_off_amx() {
    const char* allow = std::getenv("KVP_CPP_ALLOW_AMX");
    if (allow && std::strcmp(allow, "1") == 0) return false;
    return std::strstr(llama_print_system_info(), "AMX_INT8 = 1") != nullptr;
}

Model::Model(const std::string& path) {
    llama_model_params params = llama_model_default_params();
    if (keep_off_amx()) params.use_extra_bufts = false;
    model_ = llama_model_load_from_file(path.c_str(), params);
    if (!model_) throw std::runtime_error("cannot load the model " + path);
    vocab_ = llama_model_get_vocab(model_);
}

Model::~Model() { llama_model_free(model_); }

std::vector<llama_token> Model::tokenize(const std::string& text) const {
    std::vector<llama_token> tokens(text.size() + 8);
    int32_t n = llama_tokenize(vocab_, text.data(), int32_t(text.size()), tokens.data(), int32_t(tokens.size()),
                               /*add_special=*/true, /*parse_special=*/true);
    if (n < 0) {
        tokens.resize(size_t(-n));
        n = llama_tokenize(vocab_, text.data(), int32_t(text.size()), tokens.data(), int32_t(tokens.size()), true, true);
    }
    if (n < 0) throw std::runtime_error("tokenization failed");
    tokens.resize(size_t(n));
    return tokens;
}

std::string Model::detokenize(const std::vector<llama_token>& tokens) const {
    std::string text(tokens.size() * 8 + 16, '\0');
    int32_t n = llama_detokenize(vocab_, tokens.data(), int32_t(tokens.size()), text.data(), int32_t(text.size()),
                                 /*remove_special=*/false, /*unparse_special=*/false);
    if (n < 0) {
        text.resize(size_t(-n));
        n = llama_detokenize(vocab_, tokens.data(), int32_t(tokens.size()), text.data(), int32_t(text.size()), false, false);
    }
    if (n < 0) throw std::runtime_error("detokenization failed");
    text.resize(size_t(n));
    return text;
}

int64_t Model::kv_bytes_per_cell() const {
    const ModelIdentity id = model_identity(model_);
    const int64_t per_layer = ggml_row_size(GGML_TYPE_F16, int64_t(id.head_dim_k) * id.n_head_kv) +
                              ggml_row_size(GGML_TYPE_F16, int64_t(id.head_dim_v) * id.n_head_kv);
    return per_layer * id.n_layer;
}

// --- session --------------------------------------------------------------------------------------------------

namespace {

llama_flash_attn_type flash_attn_from_name(const std::string& name) {
    if (name == "auto") return LLAMA_FLASH_ATTN_TYPE_AUTO;
    if (name == "on") return LLAMA_FLASH_ATTN_TYPE_ENABLED;
    if (name == "off") return LLAMA_FLASH_ATTN_TYPE_DISABLED;
    throw std::invalid_argument("--flash-attn must be on, off or auto, not '" + name + "'");
}

}  // namespace

Session::Session(Model& model, const ContextOptions& options) : model_(model), n_batch_(options.n_batch) {
    llama_context_params params = llama_context_default_params();
    params.n_ctx = uint32_t(options.n_ctx);
    params.n_batch = params.n_ubatch = uint32_t(options.n_batch);
    params.n_seq_max = 1;
    if (options.n_threads > 0) params.n_threads = params.n_threads_batch = options.n_threads;
    params.flash_attn_type = flash_attn_from_name(options.flash_attn);
    // The callback is installed once; listen() chooses which engines it reaches. With none listening it asks
    // llama.cpp for no tensor, so decoding is not split.
    if (options.eval_callback) {
        params.cb_eval = &Session::eval_callback;
        params.cb_eval_user_data = this;
    }
    has_callback_ = options.eval_callback;
    ctx_ = llama_init_from_model(model.get(), params);
    if (!ctx_) throw std::runtime_error("cannot create a llama_context of " + std::to_string(options.n_ctx) + " cells");
    batch_ = llama_batch_init(options.n_batch, 0, 1);
}

Session::~Session() {
    llama_batch_free(batch_);
    llama_free(ctx_);
}

void Session::listen(const std::vector<Engine*>& engines) {
    listeners_.clear();
    for (Engine* engine : engines)
        if (engine->needs_callback()) listeners_.push_back(engine);
    if (!listeners_.empty() && !has_callback_)
        throw std::logic_error("an engine that captures tensors needs a session with the eval callback");
}

bool Session::eval_callback(ggml_tensor* tensor, bool ask, void* user_data) {
    auto* self = static_cast<Session*>(user_data);
    if (ask) {
        bool wanted = false;
        for (Engine* engine : self->listeners_) wanted |= Engine::eval_callback(tensor, true, engine);
        return wanted;
    }
    for (Engine* engine : self->listeners_) Engine::eval_callback(tensor, false, engine);
    return true;
}

void Session::decode(std::span<const llama_token> tokens, int64_t first_pos, size_t logits_from,
                     const LogitsSink& on_logits) {
    if (tokens.empty() || tokens.size() > size_t(n_batch_)) throw std::logic_error("batch size out of range");
    batch_.n_tokens = int32_t(tokens.size());
    for (size_t i = 0; i < tokens.size(); ++i) {
        batch_.token[i] = tokens[i];
        batch_.pos[i] = llama_pos(first_pos + int64_t(i));
        batch_.n_seq_id[i] = 1;
        batch_.seq_id[i][0] = 0;
        batch_.logits[i] = i >= logits_from;
    }
    const int32_t rc = llama_decode(ctx_, batch_);
    if (rc != 0) throw std::runtime_error("llama_decode failed with code " + std::to_string(rc));
    ++counters_.calls;
    counters_.tokens += int64_t(tokens.size());
    if (!on_logits) return;
    for (size_t i = logits_from; i < tokens.size(); ++i) {
        const float* row = llama_get_logits_ith(ctx_, int32_t(i));
        if (!row) throw std::runtime_error("llama.cpp returned no logits");
        on_logits(i, row);
    }
}

void Session::clear_sequence() { llama_memory_seq_rm(llama_get_memory(ctx_), 0, -1, -1); }

std::vector<uint8_t> Session::save_sequence() {
    std::vector<uint8_t> state(llama_state_seq_get_size(ctx_, 0));
    const size_t written = llama_state_seq_get_data(ctx_, state.data(), state.size(), 0);
    if (written == 0) throw std::runtime_error("llama_state_seq_get_data failed");
    state.resize(written);
    return state;
}

void Session::restore_sequence(const std::vector<uint8_t>& state) {
    if (llama_state_seq_set_data(ctx_, state.data(), state.size(), 0) == 0)
        throw std::runtime_error("llama_state_seq_set_data failed");
}

int64_t Session::cells_in_use() {
    // u32 io magic, i32 seq_id, u32 n_stream, then u32 cell_count of the first stream.
    const std::vector<uint8_t> state = save_sequence();
    uint32_t magic, n_stream, cell_count;
    int32_t seq_id;
    if (state.size() < 16) return -1;
    std::memcpy(&magic, state.data(), 4);
    std::memcpy(&seq_id, state.data() + 4, 4);
    std::memcpy(&n_stream, state.data() + 8, 4);
    std::memcpy(&cell_count, state.data() + 12, 4);
    if (magic != 0xaf143cd8u || seq_id != 0 || n_stream != 1) return -1;
    return int64_t(cell_count);
}

// --- writer ---------------------------------------------------------------------------------------------------

SequenceWriter::SequenceWriter(Session& session, std::vector<Engine*> engines, int64_t next_pos)
    : session_(session), engines_(std::move(engines)), next_pos_(next_pos) {
    session_.listen(engines_);
    max_cells_ = engines_.empty() ? next_pos_ : engines_.front()->stats().cells_used;
}

SequenceWriter::~SequenceWriter() { session_.listen({}); }

void SequenceWriter::feed(std::span<const llama_token> tokens, size_t logits_from, const LogitsSink& on_logits) {
    for (size_t start = 0; start < tokens.size();) {
        const int64_t remaining = int64_t(tokens.size() - start);
        int64_t n = std::min<int64_t>(remaining, session_.n_batch());
        for (Engine* engine : engines_) n = std::min(n, engine->next_batch_size(remaining, session_.n_batch()));
        const auto batch = tokens.subspan(start, size_t(n));
        const size_t batch_logits_from = logits_from > start ? logits_from - start : 0;
        const LogitsSink shifted = on_logits ? LogitsSink([&](size_t i, const float* row) { on_logits(start + i, row); })
                                             : LogitsSink();

        size_t begun = 0;
        try {
            for (; begun < engines_.size(); ++begun) {
                const int64_t pos = engines_[begun]->begin_batch(int(n), batch.data());
                if (begun == 0) next_pos_ = pos;
                else if (pos != next_pos_)
                    throw std::logic_error("engines following one sequence disagree on its positions");
            }
            session_.decode(batch, next_pos_, batch_logits_from, shifted);
        } catch (...) {
            for (size_t i = 0; i < begun; ++i) engines_[i]->abort_batch();
            throw;
        }
        for (Engine* engine : engines_) engine->end_batch();

        next_pos_ += n;
        decoded_tokens_ += n;
        start += size_t(n);
        max_cells_ = std::max(max_cells_, engines_.empty() ? next_pos_ : engines_.front()->stats().cells_used);
    }
}

std::string SequenceWriter::kept_digest() const {
    Fnv1a digest;
    if (engines_.empty()) {
        for (int64_t i = 0; i < next_pos_; ++i) digest.add_int64(i);  // the full cache holds every token
    } else {
        const Ledger& ledger = engines_.front()->ledger();
        for (size_t i = 0; i < ledger.size(); ++i) digest.add_int64(ledger.logical(i));
        // per-head mode: which heads hold each token (a shared engine's digest is unchanged)
        for (size_t i = 0; i < ledger.size(); ++i)
            for (int h = 0; h < ledger.n_holders(); ++h) digest.add_int64(ledger.held(i, h));
    }
    return digest.hex();
}

// --- logits ---------------------------------------------------------------------------------------------------

llama_token argmax(const float* logits, int32_t n_vocab) {
    return llama_token(std::max_element(logits, logits + n_vocab) - logits);
}

double negative_log_likelihood(const float* logits, int32_t n_vocab, llama_token target) {
    const float max = *std::max_element(logits, logits + n_vocab);
    double sum = 0.0;
    for (int32_t i = 0; i < n_vocab; ++i) sum += std::exp(double(logits[i]) - max);
    return std::log(sum) + max - double(logits[target]);
}

}  // namespace kvp::bench
