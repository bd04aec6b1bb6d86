// Random: an independent uniform keep-score per token. The score is a hash of (seed, logical index), not a draw
// from a running generator, so a reset, a replayed prompt or a restored state gives every token the same score.
#include "kvp/policy.h"

namespace kvp {
namespace {

uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

class RandomPolicy final : public EvictionPolicy {
public:
    explicit RandomPolicy(uint64_t seed) : seed_(splitmix64(seed)) {}
    std::string name() const override { return "random"; }
    int n_score_columns() const override { return 1; }
    void score_positions(const int64_t* logical, const int64_t*, int n, float* rows, size_t row_stride) override {
        for (int i = 0; i < n; ++i)  // the top 24 bits: a uniform float in [0, 1)
            rows[i * row_stride] = float(splitmix64(seed_ ^ uint64_t(logical[i])) >> 40) * 0x1.0p-24f;
    }

private:
    uint64_t seed_;
};

}  // namespace

std::unique_ptr<EvictionPolicy> make_random_policy(uint64_t seed) { return std::make_unique<RandomPolicy>(seed); }

}  // namespace kvp
