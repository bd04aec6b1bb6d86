// CPU kernels for the scorer's dense layers, one implementation per instruction set behind one dispatch.
#pragma once

#include <string>
#include <vector>

#include "kvp/format.h"

namespace kvp {

// y[t * n_out + o] = act(b[o] + sum_i x[t * n_in + i] * w_t[i * n_out + o])   for t < n_tokens, o < n_out
// w_t is the layer's weight transposed to n_in x n_out row-major (see pack_transposed). `apply_act` false
// leaves the affine output as is (the last layer). No heap allocation; x and y never alias.
using DenseFn = void (*)(const float* x, int n_tokens, int n_in, const float* w_t, const float* b, int n_out,
                         Activation act, bool apply_act, float* y);

// y[t] = b + sum_i x[t * n_in + i] * w[i]: the final one-output layer.
using DotFn = void (*)(const float* x, int n_tokens, int n_in, const float* w, float b, float* y);

struct KernelSet {
    const char* name;  // "scalar", "avx2", "avx512", "neon"
    DenseFn dense;
    DotFn dot;
};

// Every kernel set compiled into this build that the running CPU supports, scalar first.
std::vector<const KernelSet*> available_kernels();
// The set named `name`; throws std::invalid_argument if it is unknown, not built, or unsupported by this CPU.
const KernelSet& kernels_by_name(const std::string& name);
// The best supported set, unless the environment variable KVP_KERNEL names one (then that one, or an error).
const KernelSet& select_kernels();

std::vector<float> pack_transposed(const DenseLayer& layer);

// Scalar activation, the reference every SIMD path must match.
float activate(Activation act, float x);

}  // namespace kvp
