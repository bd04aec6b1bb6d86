// Random: an independent uniform keep-score per token, from a seeded generator (reproducible runs).
#include <random>

#include "kvp/policy.h"

namespace kvp {
namespace {

class RandomPolicy final : public EvictionPolicy {
public:
    explicit RandomPolicy(uint64_t seed) : rng_(seed) {}
    std::string name() const override { return "random"; }
    int n_score_columns() const override { return 1; }
    void score_positions(const int64_t*, const int64_t*, int n, float* rows, size_t row_stride) override {
        std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
        for (int i = 0; i < n; ++i) rows[i * row_stride] = uniform(rng_);
    }

private:
    std::mt19937_64 rng_;
};

}  // namespace

std::unique_ptr<EvictionPolicy> make_random_policy(uint64_t seed) { return std::make_unique<RandomPolicy>(seed); }

}  // namespace kvp
