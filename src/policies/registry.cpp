#include <functional>
#include <map>
#include <numeric>
#include <stdexcept>

#include "kvp/policy.h"

namespace kvp {

std::unique_ptr<EvictionPolicy> make_streaming_policy();
std::unique_ptr<EvictionPolicy> make_random_policy(uint64_t seed);
std::unique_ptr<EvictionPolicy> make_knorm_policy(const ModelIdentity& model);
std::unique_ptr<EvictionPolicy> make_keydiff_policy(const ModelIdentity& model);
std::unique_ptr<EvictionPolicy> make_lagkv_policy(const ModelIdentity& model);
std::unique_ptr<EvictionPolicy> make_tova_policy(const ModelIdentity& model, const PolicyOptions& options);
std::unique_ptr<EvictionPolicy> make_snapkv_policy(const ModelIdentity& model, const PolicyOptions& options);
std::unique_ptr<EvictionPolicy> make_observed_attention_policy(const ModelIdentity& model, const PolicyOptions& options);
std::unique_ptr<EvictionPolicy> make_h2o_policy(const ModelIdentity& model, const PolicyOptions& options);

namespace {

using Factory = std::function<std::unique_ptr<EvictionPolicy>(const ModelIdentity&, const PolicyOptions&)>;

const std::map<std::string, Factory>& builtins() {
    using M = const ModelIdentity&;
    using O = const PolicyOptions&;
    static const std::map<std::string, Factory> registry = {
        // attention-free
        {"streaming", [](M, O) { return make_streaming_policy(); }},
        {"random", [](M, O o) { return make_random_policy(o.seed); }},
        {"knorm", [](M m, O) { return make_knorm_policy(m); }},
        {"keydiff", [](M m, O) { return make_keydiff_policy(m); }},
        {"lagkv", [](M m, O) { return make_lagkv_policy(m); }},
        // attention-based: queries captured from Qcur-<layer>
        {"tova", make_tova_policy},
        {"snapkv", make_snapkv_policy},
        {"observed_attention", make_observed_attention_policy},
        {"h2o", make_h2o_policy},
    };
    return registry;
}

bool looks_like_path(const std::string& s) {
    return s.find('/') != std::string::npos || s.find('.') != std::string::npos;
}

}  // namespace

std::vector<int> per_head_score_layers(const EvictionPolicy& policy, const ModelIdentity& model) {
    std::vector<int> layers = policy.score_layers();
    if (layers.empty() && model.n_head_kv > 0 && policy.n_score_columns() == int(model.n_layer * model.n_head_kv)) {
        layers.resize(model.n_layer);
        std::iota(layers.begin(), layers.end(), 0);
    }
    if (int64_t(layers.size()) * model.n_head_kv != policy.n_score_columns()) layers.clear();
    return layers;
}

std::vector<std::string> builtin_policy_names() {
    std::vector<std::string> names;
    for (const auto& [name, factory] : builtins()) names.push_back(name);
    return names;
}

std::unique_ptr<EvictionPolicy> make_policy(const std::string& name_or_path, const ModelIdentity& model,
                                            const PolicyOptions& options) {
    if (auto it = builtins().find(name_or_path); it != builtins().end()) return it->second(model, options);
    if (!looks_like_path(name_or_path)) {
        std::string known;
        for (const auto& name : builtin_policy_names()) known += (known.empty() ? "" : ", ") + name;
        throw std::invalid_argument("unknown policy '" + name_or_path + "': use one of " + known +
                                    ", or a path to a .kvp.bin file");
    }
    auto file = std::make_shared<Policy>(load_policy(name_or_path));
    check_identity(*file, model);
    return make_learned_policy(std::move(file), options);
}

}  // namespace kvp
