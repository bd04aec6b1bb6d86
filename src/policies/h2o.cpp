// H2O (Zhang et al. 2023, FMInference/H2O): keep the heavy hitters, the tokens with the largest attention received,
// accumulated over every query since the token entered the cache (prefill and decoding) and never reset, plus a
// recent window, which here is the evictor's protected kv_recent tokens. Per (layer, KV head): the accumulated sum of
// each query head of the GQA group, averaged over the group (the original has no GQA).
#include "attention.h"

namespace kvp {
namespace {

class H2OPolicy final : public policies::ReceivedAttentionPolicy {
public:
    using ReceivedAttentionPolicy::ReceivedAttentionPolicy;

    std::string name() const override { return "h2o"; }

    void refresh_scores(Ledger& ledger) override {
        write_group_means(ledger, false, [](float sum, float) { return double(sum); });
    }
};

}  // namespace

std::unique_ptr<EvictionPolicy> make_h2o_policy(const ModelIdentity& model, const PolicyOptions& options) {
    return std::make_unique<H2OPolicy>(model, options);
}

}  // namespace kvp
