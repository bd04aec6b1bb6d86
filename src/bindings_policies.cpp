// Python bindings of the policy registry (and, with the baselines, their ranking view).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "kvp/policy.h"

namespace nb = nanobind;

namespace kvp {

void bind_policies(nb::module_& m) {
    m.def("builtin_policies", &builtin_policy_names, "Names accepted by kv_policy besides a .kvp.bin path.");
}

}  // namespace kvp
