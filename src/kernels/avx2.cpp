// AVX2 + FMA kernels. dense keeps a register tile of 8 accumulators, 4 tokens x 2 registers (16 outputs) or 8 tokens
// x 1 register, leaving ymm registers for the weights and the broadcast x; the n_out tail uses masked loads/stores.
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "kernel_sets.h"

namespace kvp {
namespace {

constexpr int kLanes = 8;
constexpr int kBlockTokens = 8;       // tokens per pass over the weights
constexpr int kTileVectors = 2;       // output registers per tile
constexpr int kMaxAccumulators = 8;   // of the 16 ymm registers

// Lanes [0, n) set, for n in [0, 8].
__m256i lanes_below(size_t n) {
    static constexpr int32_t kWindow[2 * kLanes] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kWindow + kLanes - n));
}

template <size_t N>
__m256 horner(const float (&coefficients)[N], __m256 x) {
    __m256 p = _mm256_set1_ps(coefficients[0]);
    for (size_t k = 1; k < N; ++k) p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(coefficients[k]));
    return p;
}

// 2^k for integer k in [-126, 127].
__m256 pow2(__m256i k) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23));
}

__m256 exp_ps(__m256 x) {
    using namespace vmath;
    // Operand order makes NaN propagate (maxps/minps return the second operand if either is NaN).
    x = _mm256_min_ps(_mm256_set1_ps(kExpMax), _mm256_max_ps(_mm256_set1_ps(kExpMin), x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
    const __m256 e_r =
        _mm256_fmadd_ps(horner(kExpPoly, r), _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    // 2^n in two halves, each a normal float, so that the last multiply overflows or underflows like exp.
    const __m256i n_int = _mm256_cvtps_epi32(n);
    const __m256i half = _mm256_srai_epi32(n_int, 1);
    return _mm256_mul_ps(_mm256_mul_ps(e_r, pow2(half)), pow2(_mm256_sub_epi32(n_int, half)));
}

// x / (1 + exp(z)): silu with z = -x, gelu_tanh with z = -2u.
__m256 x_over_one_plus_exp(__m256 x, __m256 z) {
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp_ps(z)));
}

__m256 tanh_ps(__m256 x) {
    using namespace vmath;
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 sign_bit = _mm256_set1_ps(-0.0f);
    const __m256 abs_x = _mm256_andnot_ps(sign_bit, x);
    const __m256 s = _mm256_mul_ps(x, x);
    const __m256 near_zero = _mm256_fmadd_ps(_mm256_mul_ps(horner(kTanhPoly, s), s), x, x);
    const __m256 e = exp_ps(_mm256_add_ps(abs_x, abs_x));
    const __m256 abs_far = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
    const __m256 far = _mm256_or_ps(abs_far, _mm256_and_ps(x, sign_bit));
    return _mm256_blendv_ps(far, near_zero, _mm256_cmp_ps(abs_x, _mm256_set1_ps(kTanhPolyLimit), _CMP_LT_OQ));
}

template <class F>
void map_inplace(float* y, size_t n, F f) {
    size_t i = 0;
    for (; i + kLanes <= n; i += kLanes) _mm256_storeu_ps(y + i, f(_mm256_loadu_ps(y + i)));
    if (i < n) {
        const __m256i m = lanes_below(n - i);
        _mm256_maskstore_ps(y + i, m, f(_mm256_maskload_ps(y + i, m)));
    }
}

void activate_inplace(Activation act, float* y, size_t n) {
    const __m256 zero = _mm256_setzero_ps();
    switch (act) {
        case Activation::relu:
            return map_inplace(y, n, [&](__m256 v) { return _mm256_max_ps(v, zero); });
        case Activation::silu:
            return map_inplace(y, n, [&](__m256 v) { return x_over_one_plus_exp(v, _mm256_sub_ps(zero, v)); });
        case Activation::gelu_tanh:
            return map_inplace(y, n, [&](__m256 v) {
                const __m256 cubic = _mm256_mul_ps(_mm256_mul_ps(v, v), _mm256_set1_ps(vmath::kGeluCubic));
                const __m256 z = _mm256_mul_ps(_mm256_fmadd_ps(cubic, v, v),
                                               _mm256_set1_ps(vmath::kGeluMinus2Sqrt2OverPi));
                return x_over_one_plus_exp(v, z);
            });
        case Activation::tanh:
            return map_inplace(y, n, [](__m256 v) { return tanh_ps(v); });
    }
    throw_invalid_activation(act);
}

// Affine outputs of kTokens tokens x kVectors registers. x, w_t, b and y start at the tile's first token and
// output; rows keep their full strides n_in (x) and n_out (w_t, y). With kMaskLast the last register only
// touches the lanes set in `last` (maskload costs an extra uop, so full tiles do without).
template <int kTokens, int kVectors, bool kMaskLast>
void dense_tile(const float* x, int n_in, const float* w_t, const float* b, int n_out, __m256i last, float* y) {
    const auto load = [last](const float* p, int v) {
        return kMaskLast && v + 1 == kVectors ? _mm256_maskload_ps(p, last) : _mm256_loadu_ps(p);
    };
    __m256 acc[kTokens][kVectors];
#pragma GCC unroll 16
    for (int v = 0; v < kVectors; ++v) {
        const __m256 bias = load(b + v * kLanes, v);
#pragma GCC unroll 16
        for (int t = 0; t < kTokens; ++t) acc[t][v] = bias;
    }
    for (int i = 0; i < n_in; ++i) {
        const float* w_row = w_t + size_t(i) * n_out;
        __m256 w[kVectors];
#pragma GCC unroll 16
        for (int v = 0; v < kVectors; ++v) w[v] = load(w_row + v * kLanes, v);
#pragma GCC unroll 16
        for (int t = 0; t < kTokens; ++t) {
            const __m256 x_ti = _mm256_broadcast_ss(x + size_t(t) * n_in + i);
#pragma GCC unroll 16
            for (int v = 0; v < kVectors; ++v) acc[t][v] = _mm256_fmadd_ps(x_ti, w[v], acc[t][v]);
        }
    }
#pragma GCC unroll 16
    for (int t = 0; t < kTokens; ++t) {
#pragma GCC unroll 16
        for (int v = 0; v < kVectors; ++v) {
            float* out = y + size_t(t) * n_out + v * kLanes;
            if (kMaskLast && v + 1 == kVectors) {
                _mm256_maskstore_ps(out, last, acc[t][v]);
            } else {
                _mm256_storeu_ps(out, acc[t][v]);
            }
        }
    }
}

// kRows tokens in tiles of up to kMaxAccumulators / kVectors tokens: a narrow tile takes more tokens, so that
// enough independent accumulators hide the FMA latency.
template <int kRows, int kVectors, bool kMaskLast>
void dense_tile_rows(const float* x, int n_in, const float* w_t, const float* b, int n_out, __m256i last, float* y) {
    constexpr int kTokens = kRows < kMaxAccumulators / kVectors ? kRows : kMaxAccumulators / kVectors;
    dense_tile<kTokens, kVectors, kMaskLast>(x, n_in, w_t, b, n_out, last, y);
    if constexpr (kRows > kTokens) {
        dense_tile_rows<kRows - kTokens, kVectors, kMaskLast>(x + size_t(kTokens) * n_in, n_in, w_t, b, n_out, last,
                                                              y + size_t(kTokens) * n_out);
    }
}

template <int kRows>
void dense_rows(const float* x, int n_in, const float* w_t, const float* b, int n_out, float* y) {
    constexpr int kTileOutputs = kTileVectors * kLanes;
    const __m256i all = lanes_below(kLanes);
    int o = 0;
    for (; o + kTileOutputs <= n_out; o += kTileOutputs) {
        dense_tile_rows<kRows, kTileVectors, false>(x, n_in, w_t + o, b + o, n_out, all, y + o);
    }
    if (o == n_out) return;
    const int full_vectors = (n_out - o) / kLanes;
    const int tail = (n_out - o) % kLanes;
    if (tail == 0) {
        with_static_count<kTileVectors>(full_vectors, [&](auto vectors) {
            dense_tile_rows<kRows, decltype(vectors)::value, false>(x, n_in, w_t + o, b + o, n_out, all, y + o);
        });
    } else {
        with_static_count<kTileVectors>(full_vectors + 1, [&](auto vectors) {
            dense_tile_rows<kRows, decltype(vectors)::value, true>(x, n_in, w_t + o, b + o, n_out, lanes_below(tail),
                                                                y + o);
        });
    }
}

void dense_avx2(const float* x, int n_tokens, int n_in, const float* w_t, const float* b, int n_out,
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

float horizontal_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

template <int kTokens>
void dot_rows(const float* x, int n_in, const float* w, float b, float* y) {
    __m256 acc[kTokens];
#pragma GCC unroll 16
    for (int t = 0; t < kTokens; ++t) acc[t] = _mm256_setzero_ps();
    int i = 0;
    for (; i + kLanes <= n_in; i += kLanes) {
        const __m256 w_i = _mm256_loadu_ps(w + i);
#pragma GCC unroll 16
        for (int t = 0; t < kTokens; ++t) {
            acc[t] = _mm256_fmadd_ps(_mm256_loadu_ps(x + size_t(t) * n_in + i), w_i, acc[t]);
        }
    }
    if (i < n_in) {
        const __m256i m = lanes_below(size_t(n_in - i));
        const __m256 w_i = _mm256_maskload_ps(w + i, m);
#pragma GCC unroll 16
        for (int t = 0; t < kTokens; ++t) {
            acc[t] = _mm256_fmadd_ps(_mm256_maskload_ps(x + size_t(t) * n_in + i, m), w_i, acc[t]);
        }
    }
#pragma GCC unroll 16
    for (int t = 0; t < kTokens; ++t) y[t] = b + horizontal_sum(acc[t]);
}

void dot_avx2(const float* x, int n_tokens, int n_in, const float* w, float b, float* y) {
    for (int t = 0; t < n_tokens; t += kBlockTokens) {
        const int rows = n_tokens - t < kBlockTokens ? n_tokens - t : kBlockTokens;
        with_static_count<kBlockTokens>(rows, [&](auto tokens) {
            dot_rows<decltype(tokens)::value>(x + size_t(t) * n_in, n_in, w, b, y + t);
        });
    }
}

constexpr KernelSet kAvx2{"avx2", dense_avx2, dot_avx2};

}  // namespace

const KernelSet* avx2_kernels() { return &kAvx2; }

}  // namespace kvp
