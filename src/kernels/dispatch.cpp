// Run-time choice of kernel set: what this build has, what this CPU supports, and the KVP_KERNEL override.
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "kernel_sets.h"

namespace kvp {

namespace {

const KernelSet* find_set(const std::vector<const KernelSet*>& sets, const std::string& name) {
    for (const KernelSet* set : sets) {
        if (name == set->name) return set;
    }
    return nullptr;
}

std::string not_available_message(const std::vector<const KernelSet*>& sets, const std::string& name) {
    const bool known = name == "scalar" || name == "avx2" || name == "avx512" || name == "neon";
    std::string message = "kernel set '" + name + "' is " +
                          (known ? "not built for or not supported by this CPU" : "unknown") + "; available: ";
    for (size_t i = 0; i < sets.size(); ++i) message += (i ? ", " : "") + std::string(sets[i]->name);
    return message;
}

}  // namespace

std::vector<const KernelSet*> available_kernels() {
    std::vector<const KernelSet*> sets{scalar_kernels()};
#if defined(KVP_HAVE_X86)
    __builtin_cpu_init();
    // Each file may use everything its -m flags allow (the compiler emits AVX-512VL/BW/DQ encodings on its own),
    // so each needs all of them, not just the headline feature.
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
        sets.push_back(avx2_kernels());
    }
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma")) {
        sets.push_back(avx512_kernels());
    }
#elif defined(KVP_HAVE_NEON)
    sets.push_back(neon_kernels());  // Advanced SIMD is mandatory on AArch64.
#endif
    return sets;
}

const KernelSet& kernels_by_name(const std::string& name) {
    const std::vector<const KernelSet*> sets = available_kernels();
    if (const KernelSet* set = find_set(sets, name)) return *set;
    throw std::invalid_argument("kvp: " + not_available_message(sets, name));
}

const KernelSet& select_kernels() {
    const std::vector<const KernelSet*> sets = available_kernels();
    const char* env = std::getenv("KVP_KERNEL");
    const std::string forced = env ? env : "";
    if (forced.empty() || forced == "auto") return *sets.back();  // listed from least to most capable
    if (const KernelSet* set = find_set(sets, forced)) return *set;
    throw std::invalid_argument("kvp: KVP_KERNEL=" + forced + ": " + not_available_message(sets, forced) +
                                " (or auto)");
}

}  // namespace kvp
