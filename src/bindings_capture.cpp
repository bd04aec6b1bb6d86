// Python bindings of the recorder: captured nodes come back as numpy arrays in numpy axis order.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>


#include "bindings_common.h"
#include "kvp/recorder.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace kvp {

void bind_capture(nb::module_& m) {
    nb::class_<Recorder>(m, "Recorder")
        .def(nb::init<std::vector<std::string>, std::vector<int>>(), "names"_a, "layers"_a = std::vector<int>{})
        .def_prop_ro("callback_address", [](const Recorder&) { return reinterpret_cast<uintptr_t>(&Recorder::eval_callback); })
        .def_prop_ro("address", [](Recorder& r) { return reinterpret_cast<uintptr_t>(&r); })
        .def_prop_ro("bytes", &Recorder::bytes)
        .def("take", [](Recorder& r) {
            // (name, layer, array) per captured node, in capture order; the array's shape is (ne3, ne2, ne1, ne0).
            nb::list out;
            for (Recorder::Capture& c : r.take()) {
                const std::array<int64_t, 4> ne = c.ne;
                out.append(nb::make_tuple(c.name, c.layer, bindings::to_numpy(std::move(c.data), {size_t(ne[3]),
                                          size_t(ne[2]), size_t(ne[1]), size_t(ne[0])})));
            }
            return out;
        });
}

}  // namespace kvp
