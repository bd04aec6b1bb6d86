// StreamingLLM: sinks plus the most recent tokens. The evictor protects the sinks; ranking the rest by recency
// makes it keep exactly the most recent tokens that fit.
#include "kvp/policy.h"

namespace kvp {
namespace {

class StreamingPolicy final : public EvictionPolicy {
public:
    std::string name() const override { return "streaming"; }
    int n_score_columns() const override { return 1; }
    void score_positions(const int64_t* logical, const int64_t*, int n, float* rows, size_t row_stride) override {
        for (int i = 0; i < n; ++i) rows[i * row_stride] = float(logical[i]);
    }
};

}  // namespace

std::unique_ptr<EvictionPolicy> make_streaming_policy() { return std::make_unique<StreamingPolicy>(); }

}  // namespace kvp
