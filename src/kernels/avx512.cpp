// AVX-512 kernels. dense keeps a register tile of accumulators, 4 tokens x 4 registers (64 outputs) or, for narrower
// remainders, up to 8 tokens, so each weight load feeds several FMAs; masked loads and stores cover any n_out, n_in.
// GCC 12 flags its own AVX-512 intrinsics (`__m512 __Y = __Y;`) as uninitialized (GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstddef>

#include "kernel_sets.h"

namespace kvp {
namespace {

constexpr int kLanes = 16;
constexpr int kBlockTokens = 8;       // tokens per pass over the weights
constexpr int kTileVectors = 4;       // output registers per tile
constexpr int kMaxAccumulators = 16;  // of the 32 zmm registers
constexpr __mmask16 kAllLanes = 0xFFFF;

__mmask16 lanes_below(size_t n) { return n >= kLanes ? kAllLanes : __mmask16((1u << n) - 1); }

template <size_t N>
__m512 horner(const float (&coefficients)[N], __m512 x) {
    __m512 p = _mm512_set1_ps(coefficients[0]);
    for (size_t k = 1; k < N; ++k) p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(coefficients[k]));
    return p;
}

__m512 exp_ps(__m512 x) {
    using namespace vmath;
    // Operand order makes NaN propagate (maxps/minps return the second operand if either is NaN).
    x = _mm512_min_ps(_mm512_set1_ps(kExpMax), _mm512_max_ps(_mm512_set1_ps(kExpMin), x));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
    const __m512 e_r =
        _mm512_fmadd_ps(horner(kExpPoly, r), _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(e_r, n);  // e_r * 2^n, overflowing and underflowing like exp
}

// x / (1 + exp(z)): silu with z = -x, gelu_tanh with z = -2u.
__m512 x_over_one_plus_exp(__m512 x, __m512 z) {
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(z)));
}

__m512 tanh_ps(__m512 x) {
    using namespace vmath;
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 abs_x = _mm512_abs_ps(x);
    const __m512 s = _mm512_mul_ps(x, x);
    const __m512 near_zero = _mm512_fmadd_ps(_mm512_mul_ps(horner(kTanhPoly, s), s), x, x);
    const __m512 e = exp_ps(_mm512_add_ps(abs_x, abs_x));
    const __m512 abs_far = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, one)));
    const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(int(0x80000000u)));
    const __m512 far = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(abs_far), sign));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(abs_x, _mm512_set1_ps(kTanhPolyLimit), _CMP_LT_OQ), far,
                                near_zero);
}

template <class F>
void map_inplace(float* y, size_t n, F f) {
    size_t i = 0;
    for (; i + kLanes <= n; i += kLanes) _mm512_storeu_ps(y + i, f(_mm512_loadu_ps(y + i)));
    if (i < n) {
        const __mmask16 m = lanes_below(n - i);
        _mm512_mask_storeu_ps(y + i, m, f(_mm512_maskz_loadu_ps(m, y + i)));
    }
}

void activate_inplace(Activation act, float* y, size_t n) {
    const __m512 zero = _mm512_setzero_ps();
    switch (act) {
        case Activation::relu:
            return map_inplace(y, n, [&](__m512 v) { return _mm512_max_ps(v, zero); });
        case Activation::silu:
            return map_inplace(y, n, [&](__m512 v) { return x_over_one_plus_exp(v, _mm512_sub_ps(zero, v)); });
        case Activation::gelu_tanh:
            return map_inplace(y, n, [&](__m512 v) {
                const __m512 cubic = _mm512_mul_ps(_mm512_mul_ps(v, v), _mm512_set1_ps(vmath::kGeluCubic));
                const __m512 z = _mm512_mul_ps(_mm512_fmadd_ps(cubic, v, v),
                                               _mm512_set1_ps(vmath::kGeluMinus2Sqrt2OverPi));
                return x_over_one_plus_exp(v, z);
            });
        case Activation::tanh:
            return map_inplace(y, n, [](__m512 v) { return tanh_ps(v); });
    }
    throw_invalid_activation(act);
}

// Affine outputs of kTokens tokens x kVectors registers. x, w_t, b and y start at the tile's first token and
// output; rows keep their full strides n_in (x) and n_out (w_t, y). Only the last register is masked, by `last`.
template <int kTokens, int kVectors>
void dense_tile(const float* x, int n_in, const float* w_t, const float* b, int n_out, __mmask16 last, float* y) {
    const auto load = [last](const float* p, int v) {
        return v + 1 < kVectors ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(last, p);
    };
    __m512 acc[kTokens][kVectors];
#pragma GCC unroll 16
    for (int v = 0; v < kVectors; ++v) {
        const __m512 bias = load(b + v * kLanes, v);
#pragma GCC unroll 16
        for (int t = 0; t < kTokens; ++t) acc[t][v] = bias;
    }
    for (int i = 0; i < n_in; ++i) {
        const float* w_row = w_t + size_t(i) * n_out;
        __m512 w[kVectors];
#pragma GCC unroll 16
        for (int v = 0; v < kVectors; ++v) w[v] = load(w_row + v * kLanes, v);
#pragma GCC unroll 16
        for (int t = 0; t < kTokens; ++t) {
            const __m512 x_ti = _mm512_set1_ps(x[size_t(t) * n_in + i]);
#pragma GCC unroll 16
            for (int v = 0; v < kVectors; ++v) acc[t][v] = _mm512_fmadd_ps(x_ti, w[v], acc[t][v]);
        }
    }
#pragma GCC unroll 16
    for (int t = 0; t < kTokens; ++t) {
#pragma GCC unroll 16
        for (int v = 0; v < kVectors; ++v) {
            float* out = y + size_t(t) * n_out + v * kLanes;
            if (v + 1 < kVectors) {
                _mm512_storeu_ps(out, acc[t][v]);
            } else {
                _mm512_mask_storeu_ps(out, last, acc[t][v]);
            }
        }
    }
}

// kRows tokens in tiles of up to kMaxAccumulators / kVectors tokens: a narrow tile takes more tokens, so that
// enough independent accumulators hide the FMA latency.
template <int kRows, int kVectors>
void dense_tile_rows(const float* x, int n_in, const float* w_t, const float* b, int n_out, __mmask16 last, float* y) {
    constexpr int kTokens = kRows < kMaxAccumulators / kVectors ? kRows : kMaxAccumulators / kVectors;
    dense_tile<kTokens, kVectors>(x, n_in, w_t, b, n_out, last, y);
    if constexpr (kRows > kTokens) {
        dense_tile_rows<kRows - kTokens, kVectors>(x + size_t(kTokens) * n_in, n_in, w_t, b, n_out, last,
                                                   y + size_t(kTokens) * n_out);
    }
}

template <int kRows>
void dense_rows(const float* x, int n_in, const float* w_t, const float* b, int n_out, float* y) {
    constexpr int kTileOutputs = kTileVectors * kLanes;
    int o = 0;
    for (; o + kTileOutputs <= n_out; o += kTileOutputs) {
        dense_tile_rows<kRows, kTileVectors>(x, n_in, w_t + o, b + o, n_out, kAllLanes, y + o);
    }
    if (o == n_out) return;
    const int rest = n_out - o;
    const int n_vectors = (rest + kLanes - 1) / kLanes;
    const __mmask16 last = lanes_below(size_t(rest - (n_vectors - 1) * kLanes));
    with_static_count<kTileVectors>(n_vectors, [&](auto vectors) {
        dense_tile_rows<kRows, decltype(vectors)::value>(x, n_in, w_t + o, b + o, n_out, last, y + o);
    });
}

void dense_avx512(const float* x, int n_tokens, int n_in, const float* w_t, const float* b, int n_out,
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
    __m512 acc[kTokens];
#pragma GCC unroll 16
    for (int t = 0; t < kTokens; ++t) acc[t] = _mm512_setzero_ps();
    for (int i = 0; i < n_in; i += kLanes) {
        const __mmask16 m = lanes_below(size_t(n_in - i));
        const __m512 w_i = _mm512_maskz_loadu_ps(m, w + i);
#pragma GCC unroll 16
        for (int t = 0; t < kTokens; ++t) {
            acc[t] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + size_t(t) * n_in + i), w_i, acc[t]);
        }
    }
#pragma GCC unroll 16
    for (int t = 0; t < kTokens; ++t) y[t] = b + _mm512_reduce_add_ps(acc[t]);
}

void dot_avx512(const float* x, int n_tokens, int n_in, const float* w, float b, float* y) {
    for (int t = 0; t < n_tokens; t += kBlockTokens) {
        const int rows = n_tokens - t < kBlockTokens ? n_tokens - t : kBlockTokens;
        with_static_count<kBlockTokens>(rows, [&](auto tokens) {
            dot_rows<decltype(tokens)::value>(x + size_t(t) * n_in, n_in, w, b, y + t);
        });
    }
}

constexpr KernelSet kAvx512{"avx512", dense_avx512, dot_avx512};

}  // namespace

const KernelSet* avx512_kernels() { return &kAvx512; }

}  // namespace kvp
