// Thin nanobind layer: numpy in, numpy out, the GIL released around native work.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <memory>

#include "bindings_common.h"
#include "kvp/engine.h"
#include "kvp/format.h"
#include "kvp/kernels.h"
#include "kvp/policy.h"
#include "kvp/scorer.h"

#include "ggml.h"
#include "llama.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using FloatIn = nb::ndarray<const float, nb::c_contig, nb::device::cpu>;
using Int64In = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using kvp::bindings::identity_dict;
using kvp::bindings::identity_from_dict;
using kvp::bindings::to_numpy;

template <typename T>
kvp::bindings::Array<T> new_array(std::initializer_list<size_t> shape) {
    return kvp::bindings::zeros<T>(shape);
}

template <typename T>
kvp::bindings::Array<T> array_from(const std::vector<T>& values, std::initializer_list<size_t> shape) {
    return to_numpy(std::vector<T>(values), shape);
}

const char* activation_name(kvp::Activation act) {
    switch (act) {
        case kvp::Activation::relu: return "relu";
        case kvp::Activation::silu: return "silu";
        case kvp::Activation::gelu_tanh: return "gelu_tanh";
        case kvp::Activation::tanh: return "tanh";
    }
    return "unknown";
}

kvp::Activation activation_from_name(const std::string& name) {
    for (auto act : {kvp::Activation::relu, kvp::Activation::silu, kvp::Activation::gelu_tanh, kvp::Activation::tanh})
        if (name == activation_name(act)) return act;
    throw nb::value_error(("unknown activation '" + name + "' (relu, silu, gelu_tanh, tanh)").c_str());
}

using PolicyPtr = std::shared_ptr<kvp::Policy>;

nb::dict agent_dict(const kvp::Policy& policy, uint32_t layer, uint32_t head) {
    if (layer >= policy.identity.n_layer || head >= policy.identity.n_head_kv)
        throw nb::index_error("layer or head out of range");
    const kvp::Agent& agent = policy.agent(layer, head);
    if (agent.dense.empty()) throw nb::value_error("this layer has no agents");
    nb::list weights, biases;
    for (const kvp::DenseLayer& dense : agent.dense) {
        weights.append(array_from(dense.weight, {dense.n_out, dense.n_in}));
        biases.append(array_from(dense.bias, {dense.n_out}));
    }
    nb::dict d;
    d["shift"] = array_from(agent.shift, {agent.shift.size()});
    d["scale"] = array_from(agent.scale, {agent.scale.size()});
    d["weights"] = weights;
    d["biases"] = biases;
    d["recency"] = array_from(agent.recency, {agent.recency.size()});
    return d;
}

kvp::HeadTokenView view_of(const FloatIn& a, const char* what) {
    if (a.ndim() != 3) throw nb::value_error((std::string(what) + " must have shape (tokens, heads, dim)").c_str());
    return kvp::HeadTokenView::contiguous(a.data(), int64_t(a.shape(0)), int64_t(a.shape(1)), int64_t(a.shape(2)));
}

}  // namespace

namespace kvp {
void bind_policies(nb::module_& m);  // src/bindings_policies.cpp
void bind_capture(nb::module_& m);   // src/bindings_capture.cpp
}  // namespace kvp

NB_MODULE(_core, m) {
    m.doc() = "kvp-cpp native core: policy format, scorer kernels and the llama.cpp eviction engine";

    nb::exception<kvp::FormatError>(m, "PolicyFormatError", PyExc_ValueError);
    m.attr("DEFAULT_HEAD_CONSENSUS") = kvp::kDefaultHeadConsensus;

    // --- what this build was compiled against, and what is loaded -------------------------------------------
    m.def("build_info", [] {
        nb::dict d;
        d["llama_cpp_python"] = KVP_BUILT_LLAMA_CPP_PYTHON;
        d["ggml_commit"] = KVP_BUILT_GGML_COMMIT;
        d["llama_h_sha256"] = KVP_BUILT_LLAMA_H_SHA256;
        return d;
    });
    m.def("runtime_ggml_commit", [] { return std::string(ggml_commit()); });

    // --- format -------------------------------------------------------------------------------------------
    nb::class_<kvp::Policy>(m, "Policy")
        .def_prop_ro("identity", [](const kvp::Policy& p) { return identity_dict(p.identity); })
        .def_ro("n_sink", &kvp::Policy::n_sink)
        .def_ro("n_recent", &kvp::Policy::n_recent)
        .def_ro("n_recency_knots", &kvp::Policy::n_recency_knots)
        .def_ro("hidden", &kvp::Policy::hidden)
        .def_ro("metadata_json", &kvp::Policy::metadata_json)
        .def_prop_ro("activation", [](const kvp::Policy& p) { return activation_name(p.activation); })
        .def_prop_ro("weight_dtype",
                     [](const kvp::Policy& p) { return p.weight_dtype == kvp::WeightDtype::f16 ? "f16" : "f32"; })
        .def_prop_ro("pos_features",
                     [](const kvp::Policy& p) {
                         std::vector<std::pair<uint32_t, float>> out;
                         for (const auto& f : p.pos_features) out.emplace_back(uint32_t(f.kind), f.a);
                         return out;
                     })
        .def_prop_ro("layer_scored",
                     [](const kvp::Policy& p) { return std::vector<bool>(p.layer_scored.begin(), p.layer_scored.end()); })
        .def_prop_ro("input_dim", &kvp::Policy::input_dim)
        .def("agent", &agent_dict, "layer"_a, "head"_a)
        .def("check_identity",
             [](const kvp::Policy& p, const nb::dict& model) { kvp::check_identity(p, identity_from_dict(model)); },
             "identity"_a);

    m.def("parse_policy",
          [](nb::bytes data) {
              return std::make_shared<kvp::Policy>(
                  kvp::parse_policy(reinterpret_cast<const uint8_t*>(data.c_str()), data.size()));
          },
          "data"_a);
    m.def("load_policy",
          [](const std::string& path) {
              nb::gil_scoped_release release;
              return std::make_shared<kvp::Policy>(kvp::load_policy(path));
          },
          "path"_a);
    m.def("crc32",
          [](nb::bytes data) { return kvp::crc32_ieee(reinterpret_cast<const uint8_t*>(data.c_str()), data.size()); },
          "data"_a);
    m.def("pos_features",
          [](const kvp::Policy& p, const Int64In& positions) {
              const size_t n = positions.shape(0), n_pos = p.pos_features.size();
              auto out = new_array<float>({n, n_pos});
              for (size_t i = 0; i < n; ++i) kvp::compute_pos_features(p.pos_features, positions.data()[i],
                                                                       out.data() + i * n_pos);
              return out;
          },
          "policy"_a, "positions"_a);

    m.def("recency_terms",
          [](const kvp::Policy& p, uint32_t layer, const Int64In& ages) {
              if (layer >= p.identity.n_layer || !p.layer_scored[layer]) throw nb::value_error("this layer has no agents");
              const size_t n = ages.shape(0), n_head = p.identity.n_head_kv;
              auto out = new_array<double>({n, n_head});
              for (size_t i = 0; i < n; ++i) {
                  if (ages.data()[i] < 1) throw nb::value_error("token ages must be at least 1");
                  for (size_t h = 0; h < n_head; ++h)
                      out.data()[i * n_head + h] =
                          kvp::recency_term(p.agent(layer, uint32_t(h)).recency.data(), p.n_recency_knots, ages.data()[i]);
              }
              return out;
          },
          "policy"_a, "layer"_a, "ages"_a,
          "(tokens, n_head_kv) recency terms of one layer's agents for token ages >= 1; zeros without recency terms");

    // --- kernels ------------------------------------------------------------------------------------------
    m.def("available_kernels", [] {
        std::vector<std::string> names;
        for (const kvp::KernelSet* set : kvp::available_kernels()) names.emplace_back(set->name);
        return names;
    });
    m.def("selected_kernel", [] { return std::string(kvp::select_kernels().name); });
    m.def("kernel_dense",
          [](const std::string& name, const FloatIn& x, const FloatIn& w, const FloatIn& b, const std::string& act,
             bool apply_act) {
              if (x.ndim() != 2 || w.ndim() != 2 || b.ndim() != 1 || w.shape(1) != x.shape(1) ||
                  b.shape(0) != w.shape(0))
                  throw nb::value_error("expected x (T, n_in), w (n_out, n_in), b (n_out,)");
              const kvp::KernelSet& kernels = kvp::kernels_by_name(name);
              kvp::DenseLayer layer{uint32_t(w.shape(1)), uint32_t(w.shape(0)),
                                    std::vector<float>(w.data(), w.data() + w.size()),
                                    std::vector<float>(b.data(), b.data() + b.size())};
              const std::vector<float> w_t = kvp::pack_transposed(layer);
              auto y = new_array<float>({x.shape(0), w.shape(0)});
              kernels.dense(x.data(), int(x.shape(0)), int(x.shape(1)), w_t.data(), b.data(), int(w.shape(0)),
                            activation_from_name(act), apply_act, y.data());
              return y;
          },
          "name"_a, "x"_a, "w"_a, "b"_a, "activation"_a, "apply_act"_a);
    m.def("kernel_dot",
          [](const std::string& name, const FloatIn& x, const FloatIn& w, float b) {
              if (x.ndim() != 2 || w.ndim() != 1 || w.shape(0) != x.shape(1))
                  throw nb::value_error("expected x (T, n_in), w (n_in,)");
              const kvp::KernelSet& kernels = kvp::kernels_by_name(name);
              auto y = new_array<float>({x.shape(0)});
              kernels.dot(x.data(), int(x.shape(0)), int(x.shape(1)), w.data(), b, y.data());
              return y;
          },
          "name"_a, "x"_a, "w"_a, "b"_a);

    // --- scorer -------------------------------------------------------------------------------------------
    nb::class_<kvp::Scorer>(m, "Scorer")
        .def(
            "__init__",
            [](kvp::Scorer* self, PolicyPtr policy, const std::string& kernel, int n_threads) {
                const kvp::KernelSet& kernels =
                    kernel == "auto" ? kvp::select_kernels() : kvp::kernels_by_name(kernel);
                new (self) kvp::Scorer(std::move(policy), kernels, n_threads);
            },
            "policy"_a, "kernel"_a = "auto", "n_threads"_a = 0)
        .def_prop_ro("kernel", [](const kvp::Scorer& s) { return std::string(s.kernels().name); })
        .def_prop_ro("n_threads", &kvp::Scorer::n_threads)
        .def_prop_ro("flops_per_token", &kvp::Scorer::flops_per_token)
        .def(
            "score_layer",
            [](const kvp::Scorer& s, int layer, const FloatIn& k, const FloatIn& v, const Int64In& positions) {
                const kvp::HeadTokenView kv = view_of(k, "k"), vv = view_of(v, "v");
                if (int64_t(positions.shape(0)) != kv.n_token)
                    throw nb::value_error("positions must have one entry per token");
                auto out = new_array<float>({size_t(kv.n_token), size_t(kv.n_head)});
                {
                    nb::gil_scoped_release release;
                    s.score_layer(layer, kv, vv, positions.data(), out.data());
                }
                return out;
            },
            "layer"_a, "k"_a, "v"_a, "positions"_a);


    // --- engine -------------------------------------------------------------------------------------------
    m.def("model_identity",
          [](uintptr_t model) { return identity_dict(kvp::model_identity(reinterpret_cast<const llama_model*>(model))); },
          "model"_a);
    m.def("kv_cache_bytes",
          [](uintptr_t model_ptr, int64_t n_cells, int type_k, int type_v) {
              const kvp::ModelIdentity id = kvp::model_identity(reinterpret_cast<const llama_model*>(model_ptr));
              const size_t per_cell_layer =
                  ggml_row_size(ggml_type(type_k), int64_t(id.head_dim_k) * id.n_head_kv) +
                  ggml_row_size(ggml_type(type_v), int64_t(id.head_dim_v) * id.n_head_kv);
              return uint64_t(n_cells) * id.n_layer * per_cell_layer;
          },
          "model"_a, "n_cells"_a, "type_k"_a, "type_v"_a);

    m.def("combined_keep_scores",
          [](const FloatIn& scores, const std::string& combine) {
              // The evictor's head combination over a block of candidates (rows) and score columns.
              if (scores.ndim() != 2) throw nb::value_error("scores must be (tokens, columns)");
              const size_t n = scores.shape(0), cols = scores.shape(1);
              kvp::Ledger ledger{int(cols)};
              std::vector<size_t> candidates(n);
              for (size_t i = 0; i < n; ++i) {
                  ledger.append(int64_t(i), int64_t(i), int64_t(i));
                  std::memcpy(ledger.scores(i), scores.data() + i * cols, cols * sizeof(float));
                  candidates[i] = i;
              }
              const std::vector<double> keep =
                  kvp::combined_keep_scores(ledger, candidates, kvp::head_combine_from_name(combine));
              return array_from(keep, {n});
          },
          "scores"_a, "combine"_a);

    nb::class_<kvp::Engine>(m, "Engine")
        .def(
            "__init__",
            [](kvp::Engine* self, uintptr_t model, const std::string& policy, int64_t budget, int64_t n_sink,
               int64_t n_recent, const std::string& position_mode, double evict_fraction, const std::string& combine,
               int64_t compact_limit, uint64_t seed, const std::string& kernel, int n_threads, bool per_head,
               std::optional<double> head_consensus, const std::string& scoring, const std::string& eviction_unit) {
                const auto* llama_model_ptr = reinterpret_cast<const llama_model*>(model);
                kvp::PolicyOptions options{seed, kernel, n_threads};
                kvp::EngineConfig config;
                config.budget = budget;
                config.position_mode = kvp::position_mode_from_name(position_mode);
                config.evict_fraction = evict_fraction;
                config.combine = kvp::head_combine_from_name(combine);
                config.compact_limit = compact_limit;
                config.per_head = per_head;
                config.head_consensus = head_consensus;
                config.scoring = kvp::scoring_path_from_name(scoring);
                config.eviction_unit = kvp::eviction_unit_from_name(eviction_unit);
                auto made = kvp::make_policy(policy, kvp::model_identity(llama_model_ptr), options);
                // Negative counts mean "what the policy was trained with".
                if (n_sink > UINT32_MAX || n_recent > UINT32_MAX) throw std::invalid_argument("kv_sink/kv_recent too large");
                config.protection = {n_sink < 0 ? made->default_sink() : uint32_t(n_sink),
                                     n_recent < 0 ? made->default_recent() : uint32_t(n_recent)};
                new (self) kvp::Engine(llama_model_ptr, std::move(made), config);
            },
            "model"_a, "policy"_a, "budget"_a, "n_sink"_a = -1, "n_recent"_a = -1, "position_mode"_a = "compact",
            "evict_fraction"_a = 0.0625, "combine"_a = "sum_softmax", "compact_limit"_a = 0, "seed"_a = 0,
            "kernel"_a = "auto", "n_threads"_a = 0, "per_head"_a = false, "head_consensus"_a = nb::none(),
            "scoring"_a = "auto", "eviction_unit"_a = "token")
        .def_prop_ro("callback_address",
                     [](const kvp::Engine& e) {
                         return e.needs_callback() ? reinterpret_cast<uintptr_t>(&kvp::Engine::eval_callback) : uintptr_t(0);
                     })
        .def_prop_ro("address", [](kvp::Engine& e) { return reinterpret_cast<uintptr_t>(&e); })
        .def_prop_ro("scores_in_graph", &kvp::Engine::scores_in_graph)
        .def_prop_ro("head_consensus", [](const kvp::Engine& e) { return *e.config().head_consensus; })
        .def_prop_ro("policy_name", [](const kvp::Engine& e) { return e.policy().name(); })
        .def_prop_ro("identity", [](const kvp::Engine& e) { return identity_dict(e.identity()); })
        .def_prop_ro("max_batch", &kvp::Engine::max_batch)
        .def_prop_ro("logical_length", &kvp::Engine::logical_length)
        .def_prop_ro("attached", &kvp::Engine::attached)
        .def("attach", [](kvp::Engine& e, uintptr_t ctx) { e.attach(reinterpret_cast<llama_context*>(ctx)); }, "ctx"_a)
        .def("detach", &kvp::Engine::detach)
        .def("next_batch_size", &kvp::Engine::next_batch_size, "remaining"_a, "n_batch"_a)
        .def(
            "begin_batch",
            [](kvp::Engine& e, int n, std::optional<std::vector<int32_t>> tokens) {
                if (tokens && tokens->size() != size_t(std::max(n, 0)))
                    throw std::invalid_argument("begin_batch got " + std::to_string(tokens->size()) + " token ids for " +
                                                std::to_string(n) + " tokens");
                return e.begin_batch(n, tokens ? tokens->data() : nullptr);
            },
            "n"_a, "tokens"_a = nb::none())
        .def_prop_ro("eviction_unit", [](const kvp::Engine& e) { return kvp::eviction_unit_name(e.config().eviction_unit); })
        .def("end_batch", &kvp::Engine::end_batch)
        .def("abort_batch", &kvp::Engine::abort_batch)
        .def("truncate", &kvp::Engine::truncate, "n_logical"_a)
        .def("forget_from", &kvp::Engine::forget_from, "n_logical"_a)
        .def("compress", &kvp::Engine::compress, "budget"_a)
        .def("set_budget", &kvp::Engine::set_budget, "budget"_a)
        .def("reset", &kvp::Engine::reset)
        .def("save", [](const kvp::Engine& e) {
            const std::vector<uint8_t> image = e.save();
            return nb::bytes(reinterpret_cast<const char*>(image.data()), image.size());
        })
        .def("restore",
             [](kvp::Engine& e, nb::bytes image) { e.restore(reinterpret_cast<const uint8_t*>(image.c_str()), image.size()); },
             "image"_a)
        .def("check_image",
             [](const kvp::Engine& e, nb::bytes image) {
                 e.check_image(reinterpret_cast<const uint8_t*>(image.c_str()), image.size());
             },
             "image"_a)
        .def("stats",
             [](const kvp::Engine& e) {
                 const kvp::EngineStats s = e.stats();
                 nb::dict d;
                 d["cells_used"] = s.cells_used;
                 d["budget"] = s.budget;
                 d["tokens_seen"] = s.tokens_seen;
                 d["tokens_evicted"] = s.tokens_evicted;
                 d["eviction_rounds"] = s.eviction_rounds;
                 d["compactions"] = s.compactions;
                 d["seq_add_calls"] = s.seq_add_calls;
                 d["seq_rm_calls"] = s.seq_rm_calls;
                 d["captured_tensors"] = s.captured_tensors;
                 d["policy_state_bytes"] = s.policy_state_bytes;
                 d["next_position"] = s.next_position;
                 d["callback_seconds"] = s.callback_seconds;
                 d["copy_seconds"] = s.copy_seconds;
                 d["score_seconds"] = s.score_seconds;
                 d["evict_seconds"] = s.evict_seconds;
                 return d;
             })
        .def("ledger", [](const kvp::Engine& e) {
            const kvp::Ledger& l = e.ledger();
            const size_t n = l.size(), cols = size_t(l.n_columns());
            auto logical = new_array<int64_t>({n}), original = new_array<int64_t>({n}), cache = new_array<int64_t>({n});
            auto scores = new_array<float>({n, cols});
            for (size_t i = 0; i < n; ++i) {
                logical.data()[i] = l.logical(i);
                original.data()[i] = l.original_pos(i);
                cache.data()[i] = l.cache_pos(i);
                std::memcpy(scores.data() + i * cols, l.scores(i), cols * sizeof(float));
            }
            nb::dict d;
            d["logical"] = logical;
            d["original_pos"] = original;
            d["cache_pos"] = cache;
            d["scores"] = scores;
            auto word = new_array<int64_t>({n});
            for (size_t i = 0; i < n; ++i) word.data()[i] = l.word(i);
            d["word"] = word;
            return d;
        });

    kvp::bind_policies(m);
    kvp::bind_capture(m);

    nb::register_exception_translator([](const std::exception_ptr& p, void*) {
        try {
            std::rethrow_exception(p);
        } catch (const std::invalid_argument& e) {
            PyErr_SetString(PyExc_ValueError, e.what());
        }
    });
}
