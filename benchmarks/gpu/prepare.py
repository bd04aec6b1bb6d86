"""Prepares what the GPU checks carry to the device machine (at most 64 MiB), into ``gpu-carry/`` (git-ignored):

- with ``--build DIR``: the patched llama.cpp built here with CUDA for sm_90 by build.sh (source in DIR/llama.cpp,
  refreshed from the patch series on every run; build in DIR/build, reused, so that a changed patch rebuilds only
  what it touches; nvcc needed, no GPU): its shared libraries, test-kvp and the two check programs, stripped, in
  bin.tar.xz. Without it: the pinned llama.cpp with kvp-cpp's patch series applied, trimmed to what libllama,
  test-kvp and the CPU and CUDA backends need, which run.sh builds on the device;
- gguf-py, and SmolLM2-135M-Instruct's metadata, tokenizer and tensor shapes (smollm2_shapes.json), from which
  make_gguf.py writes a random-weight model there;
- the check sources, make_gguf.py, build.sh, run.sh.

    CUBLAS_ROOT=... python benchmarks/gpu/prepare.py --build /tmp/gpu   # CUBLAS_ROOT where the toolkit has no cuBLAS
    # on the device: bash gpu-carry/run.sh
"""
import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import kvp_cpp
from kvp_cpp import llama_build
from kvp_cpp._llama_lib import cache_root

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
CARRY = REPO / "gpu-carry"
KEEP = ("CMakeLists.txt", "LICENSE", "cmake", "include", "src", "vendor", "licenses", "ggml", "common", "tests")
PREBUILT = ("libllama.so", "libggml.so", "libggml-base.so", "libggml-cpu.so", "libggml-cuda.so", "libllama-common.so",
            "test-kvp", "graph_scoring_check", "per_head_check")
FILES = ("check_common.h", "graph_scoring_check.cpp", "per_head_check.cpp", "make_gguf.py", "build.sh", "run.sh")
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


def pack_prebuilt(build: pathlib.Path, archive: pathlib.Path) -> None:
    """The libraries and programs, stripped, as one xz tarball (the CUDA kernels compress about fourfold); symbolic
    links (libllama.so.0 -> libllama.so.0.5.0 and the like) stay links."""
    with tempfile.TemporaryDirectory() as tmp:
        staged = pathlib.Path(tmp) / "bin"
        staged.mkdir()
        for name in PREBUILT:
            found = sorted((build / "bin").glob(name + "*"))
            if not found:
                raise SystemExit(f"{build / 'bin' / name}: missing after build.sh")
            for path in found:
                target = staged / path.name
                if path.is_symlink():
                    target.symlink_to(path.readlink())
                    continue
                shutil.copy2(path, target)
                subprocess.run(["strip", "--strip-unneeded", str(target)], check=True)
        subprocess.run(["tar", "-C", tmp, "-cJf", str(archive), "bin"], check=True,
                       env={**os.environ, "XZ_OPT": "-6 -T0"})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", type=pathlib.Path, metavar="DIR",
                        help="build here with build.sh (DIR/llama.cpp, DIR/build) and carry the binaries")
    args = parser.parse_args()
    if CARRY.exists():
        shutil.rmtree(CARRY)
    CARRY.mkdir()
    sdist = llama_build.fetch_sdist(cache_root() / "sdist")
    with tempfile.TemporaryDirectory() as tmp:
        src = llama_build.extract_llama_cpp(sdist, pathlib.Path(tmp))
        llama_build.apply_patches(src)
        shutil.copytree(src / "gguf-py", CARRY / "gguf-py")
        if args.build:
            built_src = args.build / "llama.cpp"
            # copies keep the sdist's times, so the build sees only the files the patches changed as new
            shutil.copytree(src, built_src, symlinks=True, dirs_exist_ok=True)
            subprocess.run(["bash", str(HERE / "build.sh"), str(built_src), str(args.build / "build"), str(HERE)],
                           check=True)
            pack_prebuilt(args.build / "build", CARRY / "bin.tar.xz")
        else:
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
    sys.path.insert(0, str(CARRY / "gguf-py"))
    import gguf  # the copy that travels

    shapes = model_shapes(gguf, kvp_cpp.default_model_path())
    (CARRY / "smollm2_shapes.json").write_text(json.dumps(shapes))
    for name in FILES:
        shutil.copy2(HERE / name, CARRY / name)
    size = sum(p.stat().st_size for p in CARRY.rglob("*") if p.is_file())
    print(f"{CARRY}: {size / 2**20:.1f} MiB")
    return 0 if size < 60 * 2**20 else 1


if __name__ == "__main__":
    sys.exit(main())
