"""Shared vs per-head engine at the same budget: prefill and decode tokens/s, interleaved runs in one process.

    KVP_CPP_LLAMA=per_head OMP_WAIT_POLICY=PASSIVE python benchmarks/per_head_speed.py POLICY BUDGET [--threads 1]

Prints each run and the per-head/shared ratios of the medians. A quick check, not kvp-bench: the prompt is a
repeated paragraph (~960 tokens) and decoding feeds one fixed token 64 times.
"""
import argparse
import json
import time

import numpy as np

import kvp_cpp

PARAGRAPH = ("The lighthouse keeper counted the ships every night. On Monday there were seven, on Tuesday nine, "
             "and on Wednesday a storm kept every boat in the harbour. The keeper wrote the numbers in a blue "
             "notebook and hid it under the stairs. Question: where did the keeper hide the notebook? Answer:")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("policy")
    ap.add_argument("budget", type=int)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--decode", type=int, default=64)
    args = ap.parse_args()
    runs = {"shared": [], "per_head": []}
    for rep in range(args.reps):
        for mode in (("shared", "per_head") if rep % 2 == 0 else ("per_head", "shared")):
            llm = kvp_cpp.Llama(kvp_cpp.default_model_path(), n_ctx=args.budget, kv_policy=args.policy, kv_mode=mode,
                                kv_position_mode="original", flash_attn=True, seed=0, verbose=False,
                                n_threads=args.threads)
            tokens = llm.tokenize((PARAGRAPH * 16).encode())
            t0 = time.perf_counter()
            llm.eval(tokens)
            t1 = time.perf_counter()
            for _ in range(args.decode):
                llm.eval([5])
            t2 = time.perf_counter()
            stats = llm.kv_stats()
            run = {"prefill_tps": len(tokens) / (t1 - t0), "decode_tps": args.decode / (t2 - t1),
                   "evict_seconds": stats["evict_seconds"], "score_seconds": stats["score_seconds"],
                   "tokens_evicted": stats["tokens_evicted"]}
            runs[mode].append(run)
            print(mode, json.dumps({k: round(v, 4) for k, v in run.items()}))
            llm.close()
    med = {m: {k: float(np.median([r[k] for r in v])) for k in v[0]} for m, v in runs.items()}
    print("ratio prefill", round(med["per_head"]["prefill_tps"] / med["shared"]["prefill_tps"], 3),
          "decode", round(med["per_head"]["decode_tps"] / med["shared"]["decode_tps"], 3))


if __name__ == "__main__":
    main()
