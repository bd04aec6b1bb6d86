// AArch64 NEON kernels. dense keeps a register tile of 16 accumulators, 4 tokens x 4 registers (16 outputs) or, for
// narrower remainders, up to 8 tokens. NEON has no masked loads: the last n_out % 4 outputs (and n_in % 4 inputs of
// dot) are scalar.
#include <arm_neon.h>

#include <cstddef>
#include <cstdint>

#include "kernel_sets.h"

namespace kvp {
namespace {

constexpr int kLanes = 4;
constexpr int kBlockTokens = 8;       // tokens per pass over the weights
constexpr int kTileVectors = 4;       // output registers per tile
constexpr int kMaxAccumulators = 16;  // of the 32 q registers

template <size_t N>
float32x4_t horner(const float (&coefficients)[N], float32x4_t x) {
    float32x4_t p = vdupq_n_f32(coefficients[0]);
    for (size_t k = 1; k < N; ++k) p = vfmaq_f32(vdupq_n_f32(coefficients[k]), p, x);
    return p;
}

// 2^k for integer k in [-126, 127].
float32x4_t pow2(int32x4_t k) { return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(k, vdupq_n_s32(127)), 23)); }

float32x4_t exp_ps(float32x4_t x) {
    using namespace vmath;
    x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(kExpMin)), vdupq_n_f32(kExpMax));  // NaN propagates
    const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(kLog2e)));
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(kLn2Hi));
    r = vfmsq_f32(r, n, vdupq_n_f32(kLn2Lo));
    const float32x4_t e_r = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.0f)), horner(kExpPoly, r), vmulq_f32(r, r));
    // 2^n in two halves, each a normal float, so that the last multiply overflows or underflows like exp.
    const int32x4_t n_int = vcvtq_s32_f32(n);
    const int32x4_t half = vshrq_n_s32(n_int, 1);
    return vmulq_f32(vmulq_f32(e_r, pow2(half)), pow2(vsubq_s32(n_int, half)));
}

// x / (1 + exp(z)): silu with z = -x, gelu_tanh with z = -2u.
float32x4_t x_over_one_plus_exp(float32x4_t x, float32x4_t z) {
    return vdivq_f32(x, vaddq_f32(vdupq_n_f32(1.0f), exp_ps(z)));
}

float32x4_t tanh_ps(float32x4_t x) {
    using namespace vmath;
    const float32x4_t one = vdupq_n_f32(1.0f);
    const float32x4_t abs_x = vabsq_f32(x);
    const float32x4_t s = vmulq_f32(x, x);
    const float32x4_t near_zero = vfmaq_f32(x, vmulq_f32(horner(kTanhPoly, s), s), x);
    const float32x4_t e = exp_ps(vaddq_f32(abs_x, abs_x));
    const float32x4_t abs_far = vsubq_f32(one, vdivq_f32(vdupq_n_f32(2.0f), vaddq_f32(e, one)));
    const float32x4_t far = vbslq_f32(vdupq_n_u32(0x80000000u), x, abs_far);  // abs_far with x's sign
    return vbslq_f32(vcltq_f32(abs_x, vdupq_n_f32(kTanhPolyLimit)), near_zero, far);
}

template <class F>
void map_inplace(Activation act, float* y, size_t n, F f) {
    size_t i = 0;
    for (; i + kLanes <= n; i += kLanes) vst1q_f32(y + i, f(vld1q_f32(y + i)));
    for (; i < n; ++i) y[i] = activate(act, y[i]);
}

void activate_inplace(Activation act, float* y, size_t n) {
    const float32x4_t zero = vdupq_n_f32(0.0f);
    switch (act) {
        case Activation::relu:
            // maxnm maps NaN to 0, as activate does.
            return map_inplace(act, y, n, [&](float32x4_t v) { return vmaxnmq_f32(v, zero); });
        case Activation::silu:
            return map_inplace(act, y, n, [](float32x4_t v) { return x_over_one_plus_exp(v, vnegq_f32(v)); });
        case Activation::gelu_tanh:
            return map_inplace(act, y, n, [](float32x4_t v) {
                const float32x4_t cubic = vmulq_f32(vmulq_f32(v, v), vdupq_n_f32(vmath::kGeluCubic));
                const float32x4_t z = vmulq_f32(vfmaq_f32(v, cubic, v), vdupq_n_f32(vmath::kGeluMinus2Sqrt2OverPi));
                return x_over_one_plus_exp(v, z);
            });
        case Activation::tanh:
            return map_inplace(act, y, n, [](float32x4_t v) { return tanh_ps(v); });
    }
    throw_invalid_activation(act);
}

// Affine outputs of kTokens tokens x kVectors full registers. x, w_t, b and y start at the tile's first token and
// output; rows keep their full strides n_in (x) and n_out (w_t, y).
template <int kTokens, int kVectors>
void dense_tile(const float* x, int n_in, const float* w_t, const float* b, int n_out, float* y) {
    float32x4_t acc[kTokens][kVectors];
#pragma GCC unroll 16
    for (int v = 0; v < kVectors; ++v) {
        const float32x4_t bias = vld1q_f32(b + v * kLanes);
#pragma GCC unroll 16
        for (int t = 0; t < kTokens; ++t) acc[t][v] = bias;
    }
    for (int i = 0; i < n_in; ++i) {
        const float* w_row = w_t + size_t(i) * n_out;
        float32x4_t w[kVectors];
#pragma GCC unroll 16
        for (int v = 0; v < kVectors; ++v) w[v] = vld1q_f32(w_row + v * kLanes);
#pragma GCC unroll 16
        for (int t = 0; t < kTokens; ++t) {
            const float32x4_t x_ti = vld1q_dup_f32(x + size_t(t) * n_in + i);
#pragma GCC unroll 16
            for (int v = 0; v < kVectors; ++v) acc[t][v] = vfmaq_f32(acc[t][v], x_ti, w[v]);
        }
    }
#pragma GCC unroll 16
    for (int t = 0; t < kTokens; ++t) {
#pragma GCC unroll 16
        for (int v = 0; v < kVectors; ++v) vst1q_f32(y + size_t(t) * n_out + v * kLanes, acc[t][v]);
    }
}

// The outputs [o, n_out) past the last full register, fewer than kLanes.
template <int kTokens>
void dense_tail_outputs(const float* x, int n_in, const float* w_t, const float* b, int o, int n_out, float* y) {
    for (int t = 0; t < kTokens; ++t) {
        for (int j = o; j < n_out; ++j) {
            float sum = b[j];
            for (int i = 0; i < n_in; ++i) sum += x[size_t(t) * n_in + i] * w_t[size_t(i) * n_out + j];
            y[size_t(t) * n_out + j] = sum;
        }
    }
}

// kRows tokens in tiles of up to kMaxAccumulators / kVectors tokens: a narrow tile takes more tokens, so that
// enough independent accumulators hide the FMA latency.
template <int kRows, int kVectors>
void dense_tile_rows(const float* x, int n_in, const float* w_t, const float* b, int n_out, float* y) {
    constexpr int kTokens = kRows < kMaxAccumulators / kVectors ? kRows : kMaxAccumulators / kVectors;
    dense_tile<kTokens, kVectors>(x, n_in, w_t, b, n_out, y);
    if constexpr (kRows > kTokens) {
        dense_tile_rows<kRows - kTokens, kVectors>(x + size_t(kTokens) * n_in, n_in, w_t, b, n_out,
                                                   y + size_t(kTokens) * n_out);
    }
}

template <int kRows>
void dense_rows(const float* x, int n_in, const float* w_t, const float* b, int n_out, float* y) {
    constexpr int kTileOutputs = kTileVectors * kLanes;
    int o = 0;
    for (; o + kTileOutputs <= n_out; o += kTileOutputs) {
        dense_tile_rows<kRows, kTileVectors>(x, n_in, w_t + o, b + o, n_out, y + o);
    }
    const int full_vectors = (n_out - o) / kLanes;
    if (full_vectors > 0) {
        with_static_count<kTileVectors>(full_vectors, [&](auto vectors) {
            dense_tile_rows<kRows, decltype(vectors)::value>(x, n_in, w_t + o, b + o, n_out, y + o);
        });
        o += full_vectors * kLanes;
    }
    if (o < n_out) dense_tail_outputs<kRows>(x, n_in, w_t, b, o, n_out, y);
}

void dense_neon(const float* x, int n_tokens, int n_in, const float* w_t, const float* b, int n_out,
                Activation act, bool apply_act, float* y) {
    for (int t = 0; t < n_tokens; t += kBlockTokens) {
        const int rows = n_tokens - t < kBlockTokens ? n_tokens - t : kBlockTokens;
        const float* x_rows = x + size_t(t) * n_in;
        float* y_rows = y + size_t(t) * n_out;
        with_static_count<kBlockTokens>(rows, [&](auto tokens) {
            dense_rows<decltype(tokens)::value>(x_rows, n_in, w_t, b, n_out, y_rows);
        });
        // The rows just written are still in L1.
        if (apply_act) activate_inplace(act, y_rows, size_t(rows) * n_out);
    }
}

template <int kTokens>
void dot_rows(const float* x, int n_in, const float* w, float b, float* y) {
    float32x4_t acc[kTokens];
#pragma GCC unroll 16
    for (int t = 0; t < kTokens; ++t) acc[t] = vdupq_n_f32(0.0f);
    int i = 0;
    for (; i + kLanes <= n_in; i += kLanes) {
        const float32x4_t w_i = vld1q_f32(w + i);
#pragma GCC unroll 16
        for (int t = 0; t < kTokens; ++t) acc[t] = vfmaq_f32(acc[t], vld1q_f32(x + size_t(t) * n_in + i), w_i);
    }
#pragma GCC unroll 16
    for (int t = 0; t < kTokens; ++t) {
        float sum = vaddvq_f32(acc[t]);
        for (int j = i; j < n_in; ++j) sum += x[size_t(t) * n_in + j] * w[j];
        y[t] = b + sum;
    }
}

void dot_neon(const float* x, int n_tokens, int n_in, const float* w, float b, float* y) {
    for (int t = 0; t < n_tokens; t += kBlockTokens) {
        const int rows = n_tokens - t < kBlockTokens ? n_tokens - t : kBlockTokens;
        with_static_count<kBlockTokens>(rows, [&](auto tokens) {
            dot_rows<decltype(tokens)::value>(x + size_t(t) * n_in, n_in, w, b, y + t);
        });
    }
}

constexpr KernelSet kNeon{"neon", dense_neon, dot_neon};

}  // namespace

const KernelSet* neon_kernels() { return &kNeon; }

}  // namespace kvp
