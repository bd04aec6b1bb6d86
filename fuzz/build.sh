#!/usr/bin/env bash
# Builds the libFuzzer target for the kvp.bin loader with AddressSanitizer and UndefinedBehaviorSanitizer:
#     fuzz/build.sh   ->   $KVP_FUZZ_BUILD_DIR/fuzz_policy_loader   (default build/fuzz)
# Needs clang with its runtime libraries (Debian: apt-get install -y clang). Rebuilds only when a source changed.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
out="${KVP_FUZZ_BUILD_DIR:-$repo/build/fuzz}"
cxx="${KVP_FUZZ_CXX:-clang++}"
binary="$out/fuzz_policy_loader"
sources=("$repo/fuzz/fuzz_policy_loader.cpp" "$repo/src/format.cpp" "$repo/include/kvp/format.h" "$0")

if ! command -v "$cxx" >/dev/null; then
  echo "fuzz/build.sh: $cxx not found; install clang (Debian: apt-get install -y clang)" >&2
  exit 1
fi
if [ -x "$binary" ]; then
  stale=0
  for source in "${sources[@]}"; do [ "$source" -nt "$binary" ] && stale=1; done
  [ "$stale" -eq 0 ] && exit 0
fi
mkdir -p "$out"
# -fno-sanitize-recover: an UBSan finding aborts, so libFuzzer records it as a crash instead of printing and going on.
"$cxx" -std=c++20 -g -O1 -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
  -I"$repo/include" "$repo/fuzz/fuzz_policy_loader.cpp" "$repo/src/format.cpp" -o "$binary"
echo "built $binary"
