#!/usr/bin/env bash
# The GPU checks (issues 9 and 10), on the device machine, from the repository root with gpu-carry/ carried
# (python benchmarks/gpu/prepare.py makes it here):
#
#   bash gpu-carry/run.sh            # results in $OUT (the device tool's folder), else gpu-carry/out
#
# 0. the patched llama.cpp with CUDA for sm_90: built before, in gpu-carry/bin.tar.xz (prepare.py --build), else built here
#    from gpu-carry/llama.cpp with build.sh;
# 1. writes a random-weight GGUF with SmolLM2-135M-Instruct's shapes and tokenizer (make_gguf.py);
# 2. test-kvp, llama.cpp's test of per-head eviction, with every layer on the GPU, then on the CPU;
# 3. graph_scoring_check on the GPU and on the CPU: in-graph scores against a double-precision MLP on the same
#    decode's K/V, timings of no policy / in-graph / callback, and the GPU's scores against the CPU's;
# 4. per_head_check on the GPU and on the CPU: bounded decoding with per-head eviction against shared eviction.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$HERE/out}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true; nvcc --version | tail -2; nproc; } | tee "$OUT/device.txt"

BIN=/tmp/kvp-gpu-bin/bin
if [ -f "$HERE/bin.tar.xz" ]; then
  mkdir -p /tmp/kvp-gpu-bin && tar -C /tmp/kvp-gpu-bin -xJf "$HERE/bin.tar.xz" || exit 1
else
  start=$(date +%s)
  BIN=/tmp/kvp-gpu-build/bin
  timeout 420 bash "$HERE/build.sh" "$HERE/llama.cpp" /tmp/kvp-gpu-build "$HERE" >"$OUT/build.log" 2>&1 \
    || { tail -60 "$OUT/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - start )) s" | tee -a "$OUT/device.txt"
fi
# cuBLAS and the CUDA runtime: the toolkit's, else a Python package's
libs=$BIN:/usr/local/cuda/lib64
for d in $(find / -xdev -name 'libcublas.so.13*' -not -path '*/proc/*' 2>/dev/null | xargs -r -n1 dirname | sort -u); do
  libs=$libs:$d
done
export LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
ldd "$BIN/libggml-cuda.so" | grep -E "not found|cublas|cudart" | tee -a "$OUT/device.txt"

MODEL=/tmp/smollm2-135m-random-f16.gguf
PYTHONPATH="$HERE/gguf-py" python3 "$HERE/make_gguf.py" "$HERE/smollm2_shapes.json" "$MODEL" || exit 1

status=0
step() {  # name, command...: its output in $OUT/name.log, its exit status in the summary
  local name=$1; shift
  local t0=$(date +%s)
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc ($(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
  tail -15 "$OUT/$name.log"
  [ $rc -eq 0 ] || status=1
}
step test_kvp_gpu "$BIN/test-kvp" -m "$MODEL" -ngl 99
step test_kvp_cpu "$BIN/test-kvp" -m "$MODEL" -ngl 0
step graph_scoring_gpu "$BIN/graph_scoring_check" -m "$MODEL" -ngl 99 -t 8 -o "$OUT/graph_scoring_gpu.json" \
  --dump-scores /tmp/scores_gpu.f32 --prompt 2048 --decode 128 --repeats 7
step graph_scoring_cpu "$BIN/graph_scoring_check" -m "$MODEL" -ngl 0 -t 8 -o "$OUT/graph_scoring_cpu.json" \
  --dump-scores /tmp/scores_cpu.f32 --prompt 512 --decode 32 --repeats 2
step per_head_gpu "$BIN/per_head_check" -m "$MODEL" -ngl 99 -t 8 -o "$OUT/per_head_gpu.json" \
  --budget 1024 --chunks 1,16,64 --steps 32 --repeats 5
step per_head_cpu "$BIN/per_head_check" -m "$MODEL" -ngl 0 -t 8 -o "$OUT/per_head_cpu.json" \
  --budget 1024 --chunks 1,64 --steps 8 --repeats 2

python3 - "$OUT" <<'PY'
import json, os, sys
import numpy as np
if os.path.exists("/tmp/scores_gpu.f32") and os.path.exists("/tmp/scores_cpu.f32"):
    gpu, cpu = np.fromfile("/tmp/scores_gpu.f32", np.float32), np.fromfile("/tmp/scores_cpu.f32", np.float32)
    err = float(np.abs(gpu - cpu).max() / np.abs(cpu).max())
    out = {"scores": int(cpu.size), "max_abs_diff_over_max_abs": err,
           "note": "the model's own K/V differ between the CUDA and CPU kernels; graph_scoring_*.json's correctness "
                   "block checks the scorer on identical K/V"}
    json.dump(out, open(f"{sys.argv[1]}/gpu_vs_cpu_scores.json", "w"), indent=1)
    print("GPU vs CPU scores, same prompt:", out)
PY
exit $status
