#!/usr/bin/env bash
# Sanitizer checks of the native code; .ci/run runs this after the test suite, inside the test venv.
#   1. builds kvp_core, kvp_engine and the extension with -DKVP_SANITIZE=ON (AddressSanitizer + UBSan);
#   2. runs tests/cpp/test_core.cpp, linked against those libraries, on policy files from the Python writer;
#   3. runs a Python smoke (learned policies, one with non-finite scores, streaming and random, under eviction,
#      state save/load and a refused load, compress) on that extension, with the ASan runtime preloaded into the
#      interpreter;
#   4. fuzzes the kvp.bin loader for KVP_FUZZ_SECONDS seconds (default 60) with fuzz/run.sh.
# Needs cmake, gcc (CXX, default c++: its libasan is what gets preloaded) and a Python (PYTHON, default python3)
# with kvp_cpp and llama-cpp-python installed. Installs clang with its libFuzzer runtime (apt-get, as root), the
# build requirements nanobind and nlohmann-json, and cmake when missing.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
build="${KVP_SANITIZE_BUILD_DIR:-$repo/build/sanitize}"
python="$(command -v "${PYTHON:-python3}")"
cxx="${CXX:-c++}"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:${UBSAN_OPTIONS:-}"
mkdir -p "$build/policies"

# libFuzzer needs clang and its compiler-rt (a separate package on Debian/Ubuntu: libclang-rt-N-dev, only
# recommended by clang). CI runs as root with no terminal: apt must not ask anything.
has_libfuzzer() {
  command -v clang++ >/dev/null &&
    echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' |
      clang++ -x c++ -fsanitize=fuzzer,address,undefined - -o "$build/libfuzzer-probe" >/dev/null 2>&1
}
if ! has_libfuzzer; then
  echo "sanitizers: installing clang and its libFuzzer runtime with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  apt="apt-get -y -qq -o Dpkg::Use-Pty=0 --no-install-recommends"
  apt-get update -qq >/dev/null
  command -v clang++ >/dev/null || $apt install clang >/dev/null
  major="$(clang++ --version | sed -n 's/.*clang version \([0-9]*\).*/\1/p' | head -n 1)"
  $apt install "libclang-rt-$major-dev" >/dev/null 2>&1 || true  # older releases ship it inside clang
  has_libfuzzer || { echo "sanitizers: clang++ cannot link -fsanitize=fuzzer,address,undefined" >&2; exit 1; }
fi
# The cmake build below needs what pip puts in an isolated build env for `pip install .` ([build-system] requires
# in pyproject.toml), in this Python: nanobind and nlohmann-json (llama-cpp-python is installed already).
if ! "$python" -c 'import nanobind, nlohmann_json' 2>/dev/null; then
  requires="$(sed -n 's/^requires = \[\(.*\)\]$/\1/p' "$repo/pyproject.toml" | tr -d ' "' | tr ',' '\n' |
    grep -E '^(nanobind|nlohmann-json)')"
  echo "sanitizers: installing the build requirements" $requires
  "$python" -m pip install -q $requires
fi
command -v cmake >/dev/null || "$python" -m pip install -q cmake

echo "sanitizers: building kvp_core, kvp_engine and _core with KVP_SANITIZE=ON ($cxx)"
cmake -S "$repo" -B "$build/cmake" -DKVP_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_COMPILER="$cxx" -DPython_EXECUTABLE="$python" >"$build/cmake.log" 2>&1 ||
  { cat "$build/cmake.log" >&2; exit 1; }
cmake --build "$build/cmake" --target kvp_core kvp_engine _core -j 2 >"$build/build.log" 2>&1 ||
  { tail -n 60 "$build/build.log" >&2; exit 1; }
"$cxx" -std=c++20 -g -O1 -fno-omit-frame-pointer -fsanitize=address,undefined -fopenmp -I"$repo/include" \
  "$repo/tests/cpp/test_core.cpp" "$build/cmake/libkvp_engine.a" "$build/cmake/libkvp_core.a" -o "$build/test_core"

# Odd head dims leave SIMD tails; f16 and f32, one to three hidden layers, unscored layers, every position feature.
"$python" - "$build/policies" <<'PY'
import sys
import numpy as np
from kvp_cpp import policy_file as pf

shapes = {
    "smollm2-layers-f32": dict(pf.smollm2_identity(), n_layer=3, hidden=(32,)),
    "odd-dims-f16": dict(arch="odd", n_layer=4, n_head_kv=2, head_dim_k=37, head_dim_v=19, n_ctx_train=4096,
                         hidden=(24, 9), activation="silu", weight_dtype="f16", layer_scored=[False, True, True, False],
                         pos=[(0, 4096.0), (1, 8.3), (2, 0.01), (3, 0.002)]),
    "gelu-tanh-f32": dict(arch="deep", n_layer=2, n_head_kv=1, head_dim_k=16, head_dim_v=8, n_ctx_train=512,
                          hidden=(7, 5, 3), activation="gelu_tanh", pos=[]),
    "tanh-f16": dict(arch="gemma3", n_layer=1, n_head_kv=4, head_dim_k=8, head_dim_v=8, n_ctx_train=2048,
                     hidden=(), activation="tanh", weight_dtype="f16"),
}
for seed, (name, shape) in enumerate(shapes.items()):
    data = pf.random_policy(seed=seed, **shape)
    if name in ("odd-dims-f16", "tanh-f16"):  # recency terms (a version 2 file): 5 knots, and 1
        knots = 5 if name == "odd-dims-f16" else 1
        data.recency = {key: np.linspace(1.0, -1.0, knots, dtype=np.float32) * (1 + i) for i, key in enumerate(sorted(data.agents))}
    pf.write_policy(f"{sys.argv[1]}/{name}.kvp.bin", data)
PY

echo "sanitizers: tests/cpp/test_core.cpp under ASan + UBSan"
ASAN_OPTIONS="detect_leaks=1:${ASAN_OPTIONS:-}" OMP_NUM_THREADS=2 "$build/test_core" "$build"/policies/*.kvp.bin

echo "sanitizers: Python smoke on the sanitized extension"
# The package as installed, with the sanitized _core, next to a link to the llama_cpp it was built against (the
# extension finds libllama through $ORIGIN/../llama_cpp/lib).
site="$build/site"
rm -rf "$site" && mkdir -p "$site"
cp -r "$repo/python/kvp_cpp" "$site/kvp_cpp"
cp "$build"/cmake/_core*.so "$site/kvp_cpp/"
llama_cpp_dir="$("$python" -c 'import llama_cpp, os; print(os.path.dirname(llama_cpp.__file__))')"
ln -s "$llama_cpp_dir" "$site/llama_cpp"
libasan="$("$cxx" -print-file-name=libasan.so)"
[ -f "$libasan" ] || { echo "sanitizers: $cxx has no libasan.so to preload" >&2; exit 1; }
# libstdc++ too: ASan intercepts __cxa_throw and finds the real one when it starts, before the interpreter loads
# any C++; without it the first C++ exception (llama.cpp refusing a state, an engine error) aborts in ASan's CHECK.
libstdcxx="$("$cxx" -print-file-name=libstdc++.so.6)"
[ -f "$libstdcxx" ] || { echo "sanitizers: $cxx has no libstdc++.so.6 to preload" >&2; exit 1; }
# CPython itself leaks by design: leak checking stays with test_core and the fuzzer.
PYTHONPATH="$site:$repo/tests" LD_PRELOAD="$libasan:$libstdcxx" ASAN_OPTIONS="${ASAN_OPTIONS:-}:detect_leaks=0" \
  "$python" - <<'PY'
import copy, os, tempfile
import kvp_cpp
from kvp_cpp import policy_file as pf
from test_hostile import overflowing_policy

assert kvp_cpp.__file__.startswith(os.environ["PYTHONPATH"].split(":")[0]), kvp_cpp.__file__
workdir = tempfile.mkdtemp()
learned, overflowing = os.path.join(workdir, "random.kvp.bin"), os.path.join(workdir, "overflowing.kvp.bin")
pf.write_policy(learned, pf.random_policy(**pf.smollm2_identity(), hidden=(16,), seed=3))
pf.write_policy(overflowing, overflowing_policy())  # NaN and infinite scores through the evictor
prompt = "The grass is green. The sky is blue. " * 25  # about 4x the budget
for policy in (learned, overflowing, "streaming", "random"):
    llm = kvp_cpp.Llama(kvp_cpp.default_model_path(), n_ctx=64, kv_policy=policy, n_threads=1, verbose=False)
    llm.load_state(llm.save_state())  # an empty cache
    text = llm.create_completion(prompt, max_tokens=16, temperature=0.0)["choices"][0]["text"]
    state = llm.save_state()
    spoiled = copy.copy(state)
    spoiled.llama_state = bytes(len(state.llama_state))  # llama.cpp refuses it: load_state undoes what it did
    try:
        llm.load_state(spoiled)
    except RuntimeError:
        pass
    else:
        raise AssertionError("a zeroed llama state was accepted")
    llm.load_state(state)
    llm.kv_compress(32)
    llm.eval(llm.tokenize(b" and the sun is yellow"))
    stats = llm.kv_stats()
    assert stats["tokens_evicted"] > 0 and stats["cells_used"] <= 32 and text, (stats, text)
    llm.close()
    print(f"  {os.path.basename(policy)}: {stats['tokens_seen']} tokens seen, {stats['tokens_evicted']} evicted")
PY

echo "sanitizers: fuzzing the kvp.bin loader for ${KVP_FUZZ_SECONDS:-60} s"
KVP_FUZZ_BUILD_DIR="$build/fuzz" PYTHON="$python" bash "$repo/fuzz/run.sh" "${KVP_FUZZ_SECONDS:-60}"
echo "sanitizers: no findings"
