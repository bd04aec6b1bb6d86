#!/usr/bin/env bash
# Builds the patched llama.cpp with CUDA for sm_90 (libllama, the CPU and CUDA backends, test-kvp) and the two check
# programs against it:
#
#   bash benchmarks/gpu/build.sh LLAMA_SRC BUILD_DIR CHECK_SOURCES_DIR [JOBS]
#
# No flash-attention kernels (GGML_CUDA_FA=OFF): a tenth of the build time, and neither check needs them (llama.cpp
# then runs attention without flash attention on the GPU). No VMM pool (GGML_CUDA_NO_VMM), so libcuda is not needed at
# link time: a machine with nvcc but no driver can build it. Where the CUDA toolkit has no cuBLAS, CUBLAS_ROOT names
# one (pip install --target DIR nvidia-cublas: DIR/nvidia/cu13).
set -euo pipefail
SRC=$1 BLD=$2 CHECKS=$3 JOBS=${4:-$(nproc)}
export PATH=/usr/local/cuda/bin:$PATH
extra=()
if [ -n "${CUBLAS_ROOT:-}" ]; then
  extra+=(-DCUDA_cublas_LIBRARY="$CUBLAS_ROOT/lib/libcublas.so.13" -DCUDA_cublasLt_LIBRARY="$CUBLAS_ROOT/lib/libcublasLt.so.13"
          -DCMAKE_CUDA_FLAGS="-I$CUBLAS_ROOT/include" -DCMAKE_CXX_FLAGS="-I$CUBLAS_ROOT/include")
fi
cmake -S "$SRC" -B "$BLD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
  -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF -DGGML_CUDA_NO_VMM=ON \
  -DGGML_NATIVE=OFF -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_TOOLS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF "${extra[@]}" >"$BLD.cmake.log" 2>&1 \
  || { tail -40 "$BLD.cmake.log"; exit 1; }
cmake --build "$BLD" -j"$JOBS" --target llama test-kvp
for check in graph_scoring_check per_head_check; do
  g++ -O2 -std=c++17 -I"$SRC/include" -I"$SRC/ggml/include" "$CHECKS/$check.cpp" \
    -L"$BLD/bin" -lllama -lggml -lggml-base -Wl,-rpath,'$ORIGIN' -o "$BLD/bin/$check"
done
