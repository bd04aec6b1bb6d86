"""Writes a GGUF with SmolLM2-135M-Instruct's metadata, tokenizer and tensor shapes, and random F16 weights.

Runs where the 98 MB model cannot travel (the GPU check): prepare.py saved the shapes next to this file.

    PYTHONPATH=llama.cpp/gguf-py python3 make_gguf.py smollm2_shapes.json out.gguf
"""
import json
import sys

import numpy as np

import gguf


def main(shapes_path: str, out_path: str) -> None:
    with open(shapes_path, encoding="utf-8") as f:
        shapes = json.load(f)
    writer = gguf.GGUFWriter(out_path, shapes["arch"])
    for key, field in shapes["metadata"].items():
        vtype = gguf.GGUFValueType[field["type"]]
        if key in ("general.architecture", "general.file_type"):
            continue
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, field["value"], vtype, sub_type=gguf.GGUFValueType[field["sub_type"]])
        else:
            writer.add_key_value(key, field["value"], vtype)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    rng = np.random.default_rng(0)
    for name, shape in shapes["tensors"]:
        numpy_shape = tuple(reversed(shape))  # ggml lists the fastest dimension first
        if len(shape) == 1:  # norms
            data = (1.0 + 0.05 * rng.standard_normal(numpy_shape)).astype(np.float32)
        else:
            data = (rng.standard_normal(numpy_shape, dtype=np.float32) / np.sqrt(shape[0])).astype(np.float16)
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
