"""Engine overhead: prefill and decode tokens/s with a policy against plain llama.cpp, as ratios from one run.

Runs are interleaved (plain, policies, plain, ...) and the median of --repeats is reported, so every ratio compares
runs made side by side on the same machine state. Two regimes:

- same n_ctx, nothing evicted: the pure cost of capturing K/V through the eval callback and scoring;
- a prompt of 4x the budget: the engine under eviction, against llama.cpp with a cache large enough for it all.

The per-token split of the learned policy's overhead comes from kv_stats(): time inside the callback (copies,
scoring) and the rest of the overhead, which is the graph splits and syncs the callback forces. The policies evict
whole words (the default); one more run of the learned policy ranks token by token, for the cost of the word unit.

With the patched llama.cpp loaded (KVP_CPP_LLAMA=per_head), the learned policy also runs with its MLP inside the
decode graph (kv_scoring="graph": no eval callback; scores read back once per ubatch), side by side with the
callback path.

    [KVP_CPP_LLAMA=per_head] python benchmarks/bench_engine.py [--budget 1024] [--repeats 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import kvp_cpp  # first: with KVP_CPP_LLAMA=per_head it makes llama_cpp load the patched library
from kvp_cpp import _llama_lib
from kvp_cpp import policy_file as pf

import llama_cpp  # noqa: E402


def measure(make, tokens, n_decode):
    llm = make()
    start = time.perf_counter()
    llm.eval(tokens)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for token in tokens[:n_decode]:
        llm.eval([token])
    decode = time.perf_counter() - start
    stats = llm.kv_stats() if isinstance(llm, kvp_cpp.Llama) and llm.kv_engine is not None else None
    llm.close()
    return {"prefill_tps": len(tokens) / prefill, "decode_tps": n_decode / decode, "stats": stats,
            "seconds": prefill + decode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", default=None)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", default="32", help="MLP hidden sizes of the (random-weight) learned policy")
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model = args.model or kvp_cpp.default_model_path()
    common = dict(n_batch=512, n_threads=args.threads, n_threads_batch=args.threads, verbose=False)

    tmp = tempfile.mkdtemp()
    policy_path = os.path.join(tmp, "random.kvp.bin")
    hidden = tuple(int(h) for h in args.hidden.split("x"))
    pf.write_policy(policy_path, pf.random_policy(**kvp_cpp.model_identity(model), hidden=hidden))
    vocab = llama_cpp.Llama(model, n_ctx=64, verbose=False)
    unit = vocab.tokenize(b"The grass is green. The sky is blue. The sun is yellow. Here we go.\n", add_bos=False)
    vocab.close()

    def prompt(n):
        return ([1] + unit * (n // len(unit) + 1))[:n]

    def engine(**options):
        return lambda: kvp_cpp.Llama(model, n_ctx=args.budget, **options, **common)

    in_graph = _llama_lib.loaded_library_is_patched("llama_kvp_scorer_init")
    engines = {  # the same in both regimes: the engine always holds `budget` cells
        "kvp (learned)": engine(kv_policy=policy_path, kv_scoring="callback"),
        "kvp (learned, token by token)": engine(kv_policy=policy_path, kv_scoring="callback", kv_evict_unit="token"),
        **({"kvp (learned, in graph)": engine(kv_policy=policy_path, kv_scoring="graph")} if in_graph else {}),
        "streaming": engine(kv_policy="streaming"),
    }
    regimes = {
        "no eviction (same n_ctx)": (prompt(args.budget - args.decode - 8), {
            "llama.cpp": lambda: llama_cpp.Llama(model, n_ctx=args.budget, **common), **engines}),
        "prompt 4x budget": (prompt(4 * args.budget), {
            "llama.cpp": lambda: llama_cpp.Llama(model, n_ctx=4 * args.budget + args.decode + 16, **common),
            **engines}),
    }
    report = {"budget": args.budget, "hidden": list(hidden), "threads": args.threads,
              "library": "patched" if in_graph else "stock", "regimes": {}}
    for regime, (tokens, makers) in regimes.items():
        runs = {name: [] for name in makers}
        for _ in range(args.repeats):
            for name, make in makers.items():
                runs[name].append(measure(make, tokens, args.decode))
        base = {key: statistics.median(r[key] for r in runs["llama.cpp"]) for key in ("prefill_tps", "decode_tps")}
        rows = {}
        print(f"\n#### {regime}: {len(tokens)} prompt tokens, {args.decode} decode steps, budget {args.budget}")
        print("\n| run | prefill tok/s | ratio | decode tok/s | ratio |")
        print("|---|---|---|---|---|")
        for name, results in runs.items():
            row = {key: statistics.median(r[key] for r in results) for key in ("prefill_tps", "decode_tps")}
            row["prefill_ratio"] = row["prefill_tps"] / base["prefill_tps"]
            row["decode_ratio"] = row["decode_tps"] / base["decode_tps"]
            stats = results[-1]["stats"]
            if stats:
                seen = stats["tokens_seen"]
                row["per_token_ms"] = {k: 1e3 * stats[f"{k}_seconds"] / seen for k in ("callback", "copy", "score",
                                                                                      "evict")}
            rows[name] = row
            print(f"| {name} | {row['prefill_tps']:.1f} | {row['prefill_ratio']:.3f} | {row['decode_tps']:.1f} "
                  f"| {row['decode_ratio']:.3f} |")
        split = rows["kvp (learned)"].get("per_token_ms")
        if split:
            print(f"\nkvp per token: callback {split['callback']:.4f} ms (copies {split['copy']:.4f}, scoring "
                  f"{split['score']:.4f}), eviction {split['evict']:.4f} ms")
        split = rows.get("kvp (learned, in graph)", {}).get("per_token_ms")
        if split:
            print(f"kvp in graph per token: reading the scores back {split['score']:.4f} ms, eviction "
                  f"{split['evict']:.4f} ms")
        report["regimes"][regime] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
