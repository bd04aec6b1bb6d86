#!/usr/bin/env bash
# The GPU check of in-graph scoring (issue 10), on the device machine, from the repository root with gpu-carry/
# carried (python benchmarks/gpu/prepare.py makes it here):
#
#   bash gpu-carry/run.sh            # results in $OUT (the device tool's folder), else gpu-carry/out
#
# 1. builds the patched llama.cpp with CUDA for sm_90 only (no flash-attention kernels: the check needs none),
#    and graph_scoring_check against it;
# 2. writes a random-weight GGUF with SmolLM2-135M-Instruct's shapes and tokenizer (make_gguf.py);
# 3. runs the check with every layer on the GPU and again on the CPU: in-graph scores against a double-precision
#    MLP on the same decode's K/V, timings of no policy / in-graph / callback, and the GPU's scores against the
#    CPU's for the same prompt.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$HERE/out}
mkdir -p "$OUT"
BLD=/tmp/kvp-gpu-build
export PATH=/usr/local/cuda/bin:$PATH
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true; nvcc --version | tail -2; } | tee "$OUT/device.txt"

start=$(date +%s)
cmake -S "$HERE/llama.cpp" -B "$BLD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
  -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF -DGGML_NATIVE=ON \
  -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF >"$OUT/cmake.log" 2>&1 \
  || { tail -40 "$OUT/cmake.log"; exit 1; }
timeout 480 cmake --build "$BLD" -j"$(nproc)" --target llama >"$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
g++ -O2 -std=c++17 -I"$HERE/llama.cpp/include" -I"$HERE/llama.cpp/ggml/include" "$HERE/graph_scoring_check.cpp" \
  -L"$BLD/bin" -lllama -lggml -lggml-base -Wl,-rpath,"$BLD/bin" -o "$BLD/graph_scoring_check"
echo "build: $(( $(date +%s) - start )) s" | tee -a "$OUT/device.txt"

MODEL=/tmp/smollm2-135m-random-f16.gguf
PYTHONPATH="$HERE/llama.cpp/gguf-py" python3 "$HERE/make_gguf.py" "$HERE/smollm2_shapes.json" "$MODEL"

check() {  # name, n_gpu_layers, more arguments
  local name=$1 ngl=$2; shift 2
  "$BLD/graph_scoring_check" -m "$MODEL" -ngl "$ngl" -t 8 -o "$OUT/graph_scoring_$name.json" \
    --dump-scores "/tmp/scores_$name.f32" "$@" 2>"$OUT/check_$name.log" | tee "$OUT/graph_scoring_$name.md"
}
check gpu 99 --prompt 2048 --decode 128 --repeats 7
check cpu 0 --prompt 512 --decode 32 --repeats 2

python3 - "$OUT" <<'PY'
import json, sys
import numpy as np
gpu, cpu = np.fromfile("/tmp/scores_gpu.f32", np.float32), np.fromfile("/tmp/scores_cpu.f32", np.float32)
err = float(np.abs(gpu - cpu).max() / np.abs(cpu).max())
out = {"scores": int(cpu.size), "max_abs_diff_over_max_abs": err,
       "note": "the model's own K/V differ between the CUDA and CPU kernels; graph_scoring_*.json's correctness "
               "block checks the scorer on identical K/V"}
json.dump(out, open(f"{sys.argv[1]}/gpu_vs_cpu_scores.json", "w"), indent=1)
print("GPU vs CPU scores, same prompt:", out)
PY
