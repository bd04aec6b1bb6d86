// Internal to the kernel files: each instruction-set file's KernelSet, and the constants their vector math shares.
#pragma once

#include <utility>

#include "kvp/kernels.h"

// The SIMD files are compiled with their own -m flags, so they call only intrinsics, their own internal functions
// and the templates below, instantiated with internal-linkage types: an inline function with external linkage
// (std::min, a std::vector member) could be emitted there in AVX-512 code and picked by the linker for every caller.

namespace kvp {

const KernelSet* scalar_kernels();
const KernelSet* avx2_kernels();    // defined only in x86 builds
const KernelSet* avx512_kernels();  // defined only in x86 builds
const KernelSet* neon_kernels();    // defined only in AArch64 builds

[[noreturn]] void throw_invalid_activation(Activation act);

// Calls f(std::integral_constant<int, n>{}) for a run-time 1 <= n <= kMax, so that register-tile sizes can be
// template arguments.
template <int kMax, class F>
inline void with_static_count(int n, F&& f) {
    [&]<int... k>(std::integer_sequence<int, k...>) {
        ((n == k + 1 ? f(std::integral_constant<int, k + 1>{}) : void()), ...);
    }(std::make_integer_sequence<int, kMax>{});
}

// Single-precision exp and tanh after Cephes expf/tanhf (about 1-2 ulp), written once per instruction set.
namespace vmath {

// exp(x) = 2^n * e^r with n = round(x / ln 2), |r| <= ln(2) / 2. Past +-104 the float result is inf or 0 anyway;
// the clamp keeps |n| <= 150, and each file applies 2^n so that it overflows and underflows as exp does.
inline constexpr float kExpMin = -104.0f;
inline constexpr float kExpMax = 104.0f;
inline constexpr float kLog2e = 1.44269504088896341f;
// ln 2 split so that n * kLn2Hi is exact for |n| <= 150.
inline constexpr float kLn2Hi = 0.693359375f;
inline constexpr float kLn2Lo = -2.12194440e-4f;
// e^r ~ 1 + r + r^2 * P(r), P's coefficients highest degree first.
inline constexpr float kExpPoly[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                     4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// tanh(x) ~ x + x * s * Q(s), s = x^2, for |x| < kTanhPolyLimit, where 1 - 2/(e^(2|x|) + 1) would cancel;
// Q's coefficients highest degree first.
inline constexpr float kTanhPolyLimit = 0.625f;
inline constexpr float kTanhPoly[] = {-5.70498872745e-3f, 2.06390887954e-2f, -5.37397155531e-2f,
                                      1.33314422036e-1f, -3.33332819422e-1f};

// gelu_tanh(x) = 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3). The second form
// does not cancel for negative x, and shares silu's x / (1 + exp(-z)).
inline constexpr float kGeluMinus2Sqrt2OverPi = -1.5957691216057308f;
inline constexpr float kGeluCubic = 0.044715f;

}  // namespace vmath
}  // namespace kvp
