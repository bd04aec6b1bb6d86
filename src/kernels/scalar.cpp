// Portable kernels: the reference the SIMD paths are tested against, and the fallback on any CPU.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "kernel_sets.h"

namespace kvp {

void throw_invalid_activation(Activation act) {
    throw std::invalid_argument("kvp: invalid activation " + std::to_string(static_cast<uint32_t>(act)));
}

float activate(Activation act, float x) {
    switch (act) {
        case Activation::relu:
            return x > 0.0f ? x : 0.0f;
        case Activation::silu:
            return x / (1.0f + std::exp(-x));
        case Activation::gelu_tanh:
            return x / (1.0f + std::exp(vmath::kGeluMinus2Sqrt2OverPi * (x + vmath::kGeluCubic * x * x * x)));
        case Activation::tanh:
            return std::tanh(x);
    }
    throw_invalid_activation(act);
}

std::vector<float> pack_transposed(const DenseLayer& layer) {
    const size_t n_in = layer.n_in, n_out = layer.n_out;
    if (layer.weight.size() != n_in * n_out) {
        throw std::invalid_argument("kvp: dense weight has " + std::to_string(layer.weight.size()) +
                                    " values, expected n_out * n_in = " + std::to_string(n_out) + " * " +
                                    std::to_string(n_in));
    }
    std::vector<float> w_t(n_in * n_out);
    for (size_t o = 0; o < n_out; ++o) {
        for (size_t i = 0; i < n_in; ++i) w_t[i * n_out + o] = layer.weight[o * n_in + i];
    }
    return w_t;
}

namespace {

void dense_scalar(const float* x, int n_tokens, int n_in, const float* w_t, const float* b, int n_out,
                  Activation act, bool apply_act, float* y) {
    for (int t = 0; t < n_tokens; ++t) {
        const float* __restrict x_row = x + size_t(t) * n_in;
        float* __restrict y_row = y + size_t(t) * n_out;
        std::copy(b, b + n_out, y_row);
        for (int i = 0; i < n_in; ++i) {
            const float x_i = x_row[i];
            const float* __restrict w_row = w_t + size_t(i) * n_out;
            for (int o = 0; o < n_out; ++o) y_row[o] += x_i * w_row[o];
        }
        if (apply_act) {
            for (int o = 0; o < n_out; ++o) y_row[o] = activate(act, y_row[o]);
        }
    }
}

void dot_scalar(const float* x, int n_tokens, int n_in, const float* w, float b, float* y) {
    for (int t = 0; t < n_tokens; ++t) {
        const float* x_row = x + size_t(t) * n_in;
        float sum = 0.0f;
        for (int i = 0; i < n_in; ++i) sum += x_row[i] * w[i];
        y[t] = b + sum;
    }
}

constexpr KernelSet kScalar{"scalar", dense_scalar, dot_scalar};

}  // namespace

const KernelSet* scalar_kernels() { return &kScalar; }

}  // namespace kvp
