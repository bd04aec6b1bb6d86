// ObservedAttention (kvpress ObservedAttentionPress, H2O-like): keep the tokens that received the most attention on
// average. Per (layer, query head), s_i = sum over the queries seen since the last eviction of their attention on
// token i, divided by the number of those queries that could attend to it (logical index >= i); then the mean over
// the query heads of each KV head's GQA group. A token that no such query could attend to keeps its scores. The sums
// restart after every eviction.
#include "attention.h"

namespace kvp {
namespace {

class ObservedAttentionPolicy final : public policies::ReceivedAttentionPolicy {
public:
    using ReceivedAttentionPolicy::ReceivedAttentionPolicy;

    std::string name() const override { return "observed_attention"; }

    void refresh_scores(Ledger& ledger) override {
        write_group_means(ledger, true, [](float sum, float count) { return double(sum) / double(count); });
        reset_received();
    }
};

}  // namespace

std::unique_ptr<EvictionPolicy> make_observed_attention_policy(const ModelIdentity& model, const PolicyOptions& options) {
    return std::make_unique<ObservedAttentionPolicy>(model, options);
}

}  // namespace kvp
