// Helpers shared by the binding files: numpy arrays owned by Python, and the model identity as a dict.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include "kvp/format.h"

namespace kvp::bindings {

namespace nb = nanobind;

template <typename T>
using Array = nb::ndarray<T, nb::numpy, nb::c_contig>;

// A numpy array that owns `values`.
template <typename T>
Array<T> to_numpy(std::vector<T>&& values, std::initializer_list<size_t> shape) {
    auto* owned = new std::vector<T>(std::move(values));
    nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
    return Array<T>(owned->data(), shape, owner);
}

template <typename T>
Array<T> zeros(std::initializer_list<size_t> shape) {
    size_t count = 1;
    for (size_t extent : shape) count *= extent;
    return to_numpy(std::vector<T>(count), shape);
}

inline nb::dict identity_dict(const ModelIdentity& id) {
    nb::dict d;
    d["arch"] = id.arch;
    d["n_layer"] = id.n_layer;
    d["n_head_kv"] = id.n_head_kv;
    d["head_dim_k"] = id.head_dim_k;
    d["head_dim_v"] = id.head_dim_v;
    d["n_ctx_train"] = id.n_ctx_train;
    return d;
}

inline ModelIdentity identity_from_dict(const nb::dict& d) {
    ModelIdentity id;
    id.arch = nb::cast<std::string>(d["arch"]);
    id.n_layer = nb::cast<uint32_t>(d["n_layer"]);
    id.n_head_kv = nb::cast<uint32_t>(d["n_head_kv"]);
    id.head_dim_k = nb::cast<uint32_t>(d["head_dim_k"]);
    id.head_dim_v = nb::cast<uint32_t>(d["head_dim_v"]);
    id.n_ctx_train = nb::cast<uint32_t>(d["n_ctx_train"]);
    return id;
}

}  // namespace kvp::bindings
