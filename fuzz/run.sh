#!/usr/bin/env bash
# Fuzzes the kvp.bin loader for SECONDS seconds (default 60), building the target and the seed corpus if needed:
#     fuzz/run.sh [SECONDS] [more libFuzzer flags]
# The growing corpus, the log and any crashing input live in $KVP_FUZZ_BUILD_DIR (default build/fuzz). Prints
# libFuzzer's last stats line and its final counters; exits non-zero, naming the saved input, if anything crashed.
# A crash input belongs in tests/data/fuzz_regressions/, where tests/test_hostile.py replays it through both loaders.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
out="${KVP_FUZZ_BUILD_DIR:-$repo/build/fuzz}"
export KVP_FUZZ_BUILD_DIR="$out"
seconds="${1:-60}"
shift $(( $# > 0 ? 1 : 0 ))

bash "$repo/fuzz/build.sh"
if [ ! -d "$out/seeds" ] || [ "$repo/fuzz/make_seed_corpus.py" -nt "$out/seeds" ]; then
  rm -rf "$out/seeds"
  "${PYTHON:-python3}" "$repo/fuzz/make_seed_corpus.py" "$out/seeds"
fi
mkdir -p "$out/corpus" "$out/crashes"
log="$out/fuzz.log"
# libFuzzer adds new inputs to the first folder only; the seeds and every crash found so far are read and replayed.
corpora=("$out/corpus" "$out/seeds")
[ -d "$repo/tests/data/fuzz_regressions" ] && corpora+=("$repo/tests/data/fuzz_regressions")

set +e
UBSAN_OPTIONS="print_stacktrace=1:${UBSAN_OPTIONS:-}" "$out/fuzz_policy_loader" \
  -max_total_time="$seconds" -max_len=4096 -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
  -artifact_prefix="$out/crashes/" "$@" "${corpora[@]}" >"$log" 2>&1
rc=$?
set -e

grep -E '^#[0-9]+' "$log" | tail -n 1
grep -E '^Done [0-9]+ runs|^stat::' "$log" || true
if [ "$rc" -ne 0 ]; then
  echo "fuzz/run.sh: the fuzzer stopped with exit code $rc; end of $log:" >&2
  tail -n 40 "$log" >&2
  ls -l "$out/crashes" >&2
  exit "$rc"
fi
