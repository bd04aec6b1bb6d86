"""Prepares what the GPU check carries to the device machine (at most 64 MiB), into ``gpu-carry/`` (git-ignored):

- the pinned llama.cpp with kvp-cpp's patch series applied, trimmed to what libllama with the CPU and CUDA backends
  needs (CMakeLists, cmake, include, src, vendor, ggml without the other backends) and gguf-py;
- SmolLM2-135M-Instruct's metadata, tokenizer and tensor shapes (smollm2_shapes.json), from which make_gguf.py
  writes a random-weight model there;
- graph_scoring_check.cpp, make_gguf.py, run.sh.

    python benchmarks/gpu/prepare.py      # then, on the device: bash gpu-carry/run.sh
"""
import json
import pathlib
import shutil
import sys
import tempfile

import kvp_cpp
from kvp_cpp import llama_build
from kvp_cpp._llama_lib import cache_root

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
CARRY = REPO / "gpu-carry"
KEEP = ("CMakeLists.txt", "LICENSE", "cmake", "include", "src", "vendor", "licenses", "gguf-py", "ggml")
GGML_BACKENDS_KEPT = ("ggml-cpu", "ggml-cuda")


def model_shapes(gguf_module, model_path: str) -> dict:
    reader = gguf_module.GGUFReader(model_path)
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        vtype = field.types[0]
        if vtype == gguf_module.GGUFValueType.ARRAY:
            sub = field.types[1]
            values = [field.parts[i] for i in field.data]
            if sub == gguf_module.GGUFValueType.STRING:
                value = [bytes(v).decode("utf-8") for v in values]
            else:
                value = [v.tolist()[0] for v in values]
            metadata[key] = {"type": vtype.name, "sub_type": sub.name, "value": value}
        elif vtype == gguf_module.GGUFValueType.STRING:
            metadata[key] = {"type": vtype.name, "value": bytes(field.parts[field.data[0]]).decode("utf-8")}
        else:
            metadata[key] = {"type": vtype.name, "value": field.parts[field.data[0]].tolist()[0]}
    tensors = [[t.name, [int(x) for x in t.shape]] for t in reader.tensors]
    return {"arch": metadata["general.architecture"]["value"], "metadata": metadata, "tensors": tensors}


def main() -> int:
    if CARRY.exists():
        shutil.rmtree(CARRY)
    CARRY.mkdir()
    sdist = llama_build.fetch_sdist(cache_root() / "sdist")
    with tempfile.TemporaryDirectory() as tmp:
        src = llama_build.extract_llama_cpp(sdist, pathlib.Path(tmp))
        llama_build.apply_patches(src)
        dst = CARRY / "llama.cpp"
        dst.mkdir()
        for name in KEEP:
            path = src / name
            if path.is_dir():
                shutil.copytree(path, dst / name)
            elif path.exists():
                shutil.copy2(path, dst / name)
        for backend in (dst / "ggml" / "src").iterdir():
            if backend.is_dir() and backend.name.startswith("ggml-") and backend.name not in GGML_BACKENDS_KEPT:
                shutil.rmtree(backend)
    sys.path.insert(0, str(CARRY / "llama.cpp" / "gguf-py"))
    import gguf  # the copy that travels

    shapes = model_shapes(gguf, kvp_cpp.default_model_path())
    (CARRY / "smollm2_shapes.json").write_text(json.dumps(shapes))
    for name in ("graph_scoring_check.cpp", "make_gguf.py", "run.sh"):
        shutil.copy2(HERE / name, CARRY / name)
    size = sum(p.stat().st_size for p in CARRY.rglob("*") if p.is_file())
    print(f"{CARRY}: {size / 2**20:.1f} MiB")
    return 0 if size < 60 * 2**20 else 1


if __name__ == "__main__":
    sys.exit(main())
