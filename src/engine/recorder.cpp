#include "kvp/recorder.h"

#include <algorithm>
#include <cstring>

#include "ggml-backend.h"
#include "ggml.h"

namespace kvp {

Recorder::Recorder(std::vector<std::string> names, std::vector<int> layers)
    : names_(std::move(names)), layers_(std::move(layers)) {
    std::sort(layers_.begin(), layers_.end());
}

bool Recorder::wants(const ggml_tensor* t, int* name_index, int* layer) const {
    if (t->type != GGML_TYPE_F32) return false;
    const char* dash = std::strrchr(t->name, '-');
    if (!dash || dash[1] == '\0') return false;
    int l = 0;
    for (const char* c = dash + 1; *c; ++c) {
        if (*c < '0' || *c > '9' || l > 100000) return false;
        l = l * 10 + (*c - '0');
    }
    if (!layers_.empty() && !std::binary_search(layers_.begin(), layers_.end(), l)) return false;
    const size_t prefix = size_t(dash - t->name);
    for (size_t i = 0; i < names_.size(); ++i) {
        const std::string& name = names_[i];
        if (name.size() != prefix || std::strncmp(t->name, name.data(), prefix) != 0) continue;
        if ((name == "Qcur" || name == "Kcur") && t->op != GGML_OP_ROPE) return false;
        if (name == "Vcur" && t->op != GGML_OP_RESHAPE) return false;
        *name_index = int(i);
        *layer = l;
        return true;
    }
    return false;
}

void Recorder::record(const ggml_tensor* t, int name_index, int layer) {
    std::vector<uint8_t> raw(ggml_nbytes(t));
    if (t->buffer && ggml_backend_buffer_is_host(t->buffer))
        std::memcpy(raw.data(), t->data, raw.size());
    else
        ggml_backend_tensor_get(t, raw.data(), 0, raw.size());
    Capture capture{names_[name_index], layer, {t->ne[0], t->ne[1], t->ne[2], t->ne[3]}, {}};
    capture.data.resize(size_t(ggml_nelements(t)));
    float* out = capture.data.data();
    for (int64_t i3 = 0; i3 < t->ne[3]; ++i3)
        for (int64_t i2 = 0; i2 < t->ne[2]; ++i2)
            for (int64_t i1 = 0; i1 < t->ne[1]; ++i1) {
                const uint8_t* row = raw.data() + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3];
                for (int64_t i0 = 0; i0 < t->ne[0]; ++i0)
                    *out++ = *reinterpret_cast<const float*>(row + i0 * t->nb[0]);
            }
    captures_.push_back(std::move(capture));
}

bool Recorder::eval_callback(ggml_tensor* t, bool ask, void* user_data) {
    auto* recorder = static_cast<Recorder*>(user_data);
    int name_index, layer;
    if (!recorder->wants(t, &name_index, &layer)) return !ask;
    if (!ask) recorder->record(t, name_index, layer);
    return true;
}

std::vector<Recorder::Capture> Recorder::take() {
    std::vector<Capture> out;
    out.swap(captures_);
    return out;
}

size_t Recorder::bytes() const {
    size_t total = 0;
    for (const Capture& c : captures_) total += c.data.size() * sizeof(float);
    return total;
}

}  // namespace kvp
