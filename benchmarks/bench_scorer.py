"""Scorer cost against the model's own speed, measured side by side in one run.

For each CPU kernel and MLP size it scores all (layer, KV head) agents of the model (90 for SmolLM2) on a
prefill-sized block and on single decode tokens, and reports tokens/s, FLOPs per token and the scorer's time as a
share of the model's own prefill and decode time per token on this CPU (same threads, same run).

    python benchmarks/bench_scorer.py [-m model.gguf] [--threads 2] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
import llama_cpp

import kvp_cpp
from kvp_cpp import policy_file as pf

SIZES = [(16,), (32,), (64,), (128,), (256,), (256, 256)]


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def model_speed(model: str, threads: int, n_prompt: int = 512, n_decode: int = 32) -> dict:
    llm = llama_cpp.Llama(model, n_ctx=n_prompt + n_decode + 16, n_batch=512, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    tokens = (llm.tokenize(b"The grass is green. The sky is blue. " * 100))[:n_prompt]

    def prefill():
        llm.reset()
        llm.eval(tokens)

    prefill_s = best_of(prefill, 3)
    start = time.perf_counter()
    for i in range(n_decode):
        llm.eval([tokens[i]])
    decode_s = (time.perf_counter() - start) / n_decode
    params = llama_cpp.llama_model_n_params(llm._model.model)
    llm.close()
    return {"prefill_ms_per_token": 1e3 * prefill_s / n_prompt, "decode_ms_per_token": 1e3 * decode_s,
            "model_flops_per_token": 2.0 * params}


def scorer_speed(identity: dict, hidden: tuple, kernel: str, threads: int) -> dict:
    data = pf.random_policy(**identity, hidden=hidden, seed=0)
    policy = kvp_cpp.parse_policy(pf.encode_policy(data))
    scorer = kvp_cpp.Scorer(policy, kernel=kernel, n_threads=threads)
    rng = np.random.default_rng(0)
    n_head, dk, dv = identity["n_head_kv"], identity["head_dim_k"], identity["head_dim_v"]
    layers = [layer for layer in range(identity["n_layer"])]
    result = {"hidden": list(hidden), "kernel": kernel, "flops_per_token": scorer.flops_per_token,
              "params_per_agent": int(sum(w.size + b.size for w in data.agents[0, 0].weights
                                          for b in data.agents[0, 0].biases[:1]))}
    for label, n_tokens, repeats in (("prefill", 512, 5), ("decode", 1, 200)):
        k = rng.standard_normal((n_tokens, n_head, dk)).astype(np.float32)
        v = rng.standard_normal((n_tokens, n_head, dv)).astype(np.float32)
        positions = np.arange(n_tokens, dtype=np.int64)

        def run():
            for layer in layers:
                scorer.score_layer(layer, k, v, positions)

        seconds = best_of(run, repeats)
        result[f"{label}_ms_per_token"] = 1e3 * seconds / n_tokens
        result[f"{label}_tokens_per_s"] = n_tokens / seconds
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model = args.model or kvp_cpp.default_model_path()
    identity = kvp_cpp.model_identity(model)

    base = model_speed(model, args.threads)
    rows = [scorer_speed(identity, hidden, kernel, args.threads)
            for hidden in SIZES for kernel in kvp_cpp.available_kernels()]

    n_agents = identity["n_layer"] * identity["n_head_kv"]
    print(f"# scorer vs model, {identity['arch']} ({n_agents} agents), {platform.processor() or platform.machine()}, "
          f"{args.threads} threads")
    print(f"# model: prefill {base['prefill_ms_per_token']:.3f} ms/token, decode {base['decode_ms_per_token']:.2f} "
          f"ms/token, {base['model_flops_per_token'] / 1e6:.0f} MFLOP/token (2 x params)")
    print("\n| hidden | kernel | MFLOP/token | % model FLOPs | prefill tok/s | % of prefill time | decode ms/token "
          "| % of decode time |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {'x'.join(map(str, r['hidden']))} | {r['kernel']} | {r['flops_per_token'] / 1e6:.2f} "
              f"| {100 * r['flops_per_token'] / base['model_flops_per_token']:.2f} "
              f"| {r['prefill_tokens_per_s']:.0f} "
              f"| {100 * r['prefill_ms_per_token'] / base['prefill_ms_per_token']:.2f} "
              f"| {r['decode_ms_per_token']:.3f} | {100 * r['decode_ms_per_token'] / base['decode_ms_per_token']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"identity": identity, "threads": args.threads, "model": base, "scorer": rows}, f, indent=1)


if __name__ == "__main__":
    main()
