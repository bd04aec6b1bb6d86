#include "policies.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>

#include "digest.h"
#include "results.h"

namespace kvp::bench {

namespace {

constexpr const char* kFull = "full";
constexpr const char* kLearnedPrefix = "kvp:";

bool ends_with(const std::string& s, const std::string& suffix) {
    return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// What make_policy() takes for a label: a built-in name or a policy file path; empty for `full`.
std::string policy_source(const std::string& label) {
    if (label == kFull) return "";
    if (label.rfind(kLearnedPrefix, 0) == 0) return label.substr(std::string(kLearnedPrefix).size());
    const std::vector<std::string> builtins = builtin_policy_names();
    if (std::find(builtins.begin(), builtins.end(), label) != builtins.end()) return label;
    if (label.find('/') != std::string::npos || ends_with(label, ".kvp.bin")) return label;
    std::string known = kFull;
    for (const std::string& name : builtins) known += ", " + name;
    throw std::invalid_argument("unknown policy '" + label + "': use one of " + known +
                                ", kvp:PATH or a path to a .kvp.bin file");
}

}  // namespace

std::vector<std::string> split_list(const std::string& text) {
    std::vector<std::string> items;
    std::stringstream stream(text);
    for (std::string item; std::getline(stream, item, ',');)
        if (!item.empty()) items.push_back(item);
    return items;
}

PolicyFactory::PolicyFactory(const std::string& label, const llama_model* model, const EngineOptions& options)
    : label_(label), source_(policy_source(label)), model_(model), identity_(model_identity(model)), options_(options) {
    if (is_full()) {
        policy_name_ = kFull;
        return;
    }
    const std::vector<std::string> builtins = builtin_policy_names();
    if (std::find(builtins.begin(), builtins.end(), source_) == builtins.end()) {
        const std::vector<uint8_t> image = read_policy_file(source_);
        auto file = std::make_shared<Policy>(parse_policy_file(image, source_));
        check_identity(*file, identity_);
        file_ = std::move(file);
        Fnv1a digest;
        digest.add_bytes(image.data(), image.size());
        file_digest_ = digest.hex();
    }
    const std::unique_ptr<EvictionPolicy> probe = make_policy();
    policy_name_ = probe->name();
    attention_based_ = !probe->query_layers().empty();
    captures_kv_ = !probe->capture_layers().empty();
    scores_per_head_ = !per_head_score_layers(*probe, identity_).empty();
    scores_per_token_ = probe->n_score_columns() == 1;
    if (options.n_sink > int64_t(UINT32_MAX) || options.n_recent > int64_t(UINT32_MAX))
        throw std::invalid_argument("--sink/--recent too large");
    protection_ = {options.n_sink < 0 ? probe->default_sink() : uint32_t(options.n_sink),
                   options.n_recent < 0 ? probe->default_recent() : uint32_t(options.n_recent)};
}

bool runs_in_mode(const PolicyFactory& policy, const std::string& mode, const std::vector<std::string>& modes) {
    if (mode == kSharedMode || policy.scores_per_head()) return true;
    return policy.scores_per_token() && std::find(modes.begin(), modes.end(), kSharedMode) == modes.end();
}

std::unique_ptr<EvictionPolicy> PolicyFactory::make_policy() const {
    const PolicyOptions options{options_.seed, "auto", options_.n_threads};
    if (file_) return make_learned_policy(file_, options);
    return kvp::make_policy(source_, identity_, options);
}

std::unique_ptr<Engine> PolicyFactory::make_engine(int64_t budget, bool per_head, bool original_positions) const {
    if (is_full()) throw std::logic_error("the full cache has no engine");
    EngineConfig config;
    config.per_head = per_head;
    if (per_head || original_positions) config.position_mode = PositionMode::original;
    config.budget = budget;
    config.protection = protection_;
    config.combine = options_.combine;
    config.evict_fraction = options_.evict_fraction;
    if (per_head) config.head_consensus = options_.head_consensus;
    config.scoring = options_.scoring;
    config.eviction_unit = options_.eviction_unit;
    config.stretch = options_.stretch;  // check_policies refuses it with per_head
    return std::make_unique<Engine>(model_, make_policy(), config);
}

}  // namespace kvp::bench
