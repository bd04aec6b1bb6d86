"""Soak test: a long chat under a fixed KV budget must not grow the process or the cache.

Generates --tokens tokens in a chat loop (user turn, sampled assistant reply, repeat) on the default model, with a
random-weight learned policy by default, so that capture, scoring and eviction all run on every token. Every
--sample-every generated tokens it records the cells in use and the RSS (VmRSS of /proc/self/status) twice: as it
is, and as live memory, after gc.collect() and glibc's malloc_trim(0). The second takes out what is freed but not yet
given back: llama-cpp-python's samplers sit in reference cycles, so each discarded one (with its native buffers) waits
for Python's rarer full collections, and glibc keeps freed heap pages. A leak shows in the live RSS; those do not.
After every token it checks the cells against the budget. Passes when the live RSS grows less than --max-growth (5%)
from the end of the warm-up to any later sample, and the cells never exceed the budget. Writes a JSON report and a
PNG of the curves.

Each turn appends the user's tokens to the history the cache already holds (generate(..., reset=False)), so nothing is
re-evaluated and the loop keeps nothing that grows with the conversation besides llama-cpp-python's input_ids (4 bytes
a token); generate() builds one sampler per reply, where Llama.sample() on its own would build one per token.

    python benchmarks/soak.py [--tokens 100000] [--budget 512] [--policy learned|streaming|random|PATH]
                              [--json benchmarks/results/soak.json] [--png benchmarks/results/soak.png]

Exit status 0 when it passes, 1 when it does not.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import itertools
import json
import os
import platform
import sys
import tempfile
import time

import kvp_cpp
from kvp_cpp import policy_file as pf

TOPICS = ["the sea", "a mountain village", "the history of bread", "a robot learning to paint", "winter mornings",
          "how bridges stand", "a lost key", "the moon landing", "a library at night", "bees"]  # fmt: skip
REQUESTS = ["Tell me something about {}.", "Write a short poem about {}.", "What is surprising about {}?",
            "Summarise what we said so far, then add a thought about {}.", "Explain {} to a child."]  # fmt: skip


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def live_rss_bytes() -> int:
    """The RSS once unreachable Python objects are freed and glibc has returned its free heap pages."""
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    return rss_bytes()


def user_turn(llm, turn: int) -> list:
    """ChatML tokens that close the previous assistant reply (if any), ask the next question and open the reply."""
    request = REQUESTS[turn % len(REQUESTS)].format(TOPICS[turn % len(TOPICS)])
    opening = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n" if turn == 0 else "<|im_end|>\n"
    text = f"{opening}<|im_start|>user\n{request}<|im_end|>\n<|im_start|>assistant\n"
    return llm.tokenize(text.encode(), add_bos=False, special=True)


def resolve_policy(name: str, model: str, workdir: str) -> str:
    if name != "learned":
        return name
    path = os.path.join(workdir, "random.kvp.bin")
    pf.write_policy(path, pf.random_policy(**kvp_cpp.model_identity(model), hidden=(32,), seed=0))
    return path


def run(args) -> dict:
    model = args.model or kvp_cpp.default_model_path()
    with tempfile.TemporaryDirectory() as workdir:  # the engine reads a policy file into memory once
        policy = resolve_policy(args.policy, model, workdir)
        llm = kvp_cpp.Llama(model, n_ctx=args.budget, kv_policy=policy, kv_budget=args.budget, seed=args.seed,
                            n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    engine = llm.kv_engine
    eos = llm.token_eos()
    samples, max_cells, generated, turns = [], 0, 0, 0
    start = time.perf_counter()
    while generated < args.tokens:
        reply = llm.generate(user_turn(llm, turns), reset=False, temp=args.temperature, top_k=40, top_p=0.95,
                             repeat_penalty=1.1)
        turns += 1
        for token in itertools.islice(reply, args.reply_tokens):
            max_cells = max(max_cells, engine.stats()["cells_used"])
            generated += 1
            if generated % args.sample_every == 0:
                stats = engine.stats()
                samples.append({"tokens": generated, "tokens_seen": stats["tokens_seen"],
                                "tokens_evicted": stats["tokens_evicted"], "cells_used": stats["cells_used"],
                                "rss_bytes": rss_bytes(), "rss_live_bytes": live_rss_bytes(),
                                "seconds": time.perf_counter() - start, "turns": turns})  # fmt: skip
                print(f"{generated:>8} tokens  RSS {samples[-1]['rss_bytes'] / 2**20:7.1f} MiB, live "
                      f"{samples[-1]['rss_live_bytes'] / 2**20:7.1f} MiB  {stats['cells_used']:>4} cells  "
                      f"{samples[-1]['seconds']:6.0f} s", flush=True)
            if token == eos or generated >= args.tokens:
                break
        reply.close()
    elapsed = time.perf_counter() - start
    stats = llm.kv_stats()
    llm.close()

    after_warm_up = [s for s in samples if s["tokens"] >= args.warmup]
    if not after_warm_up:
        raise SystemExit(f"--tokens {args.tokens} leaves no sample after the {args.warmup}-token warm-up")
    baseline = after_warm_up[0]["rss_live_bytes"]
    peak = max(s["rss_live_bytes"] for s in after_warm_up)
    growth = (peak - baseline) / baseline
    raw_baseline = after_warm_up[0]["rss_bytes"]
    raw_growth = (max(s["rss_bytes"] for s in after_warm_up) - raw_baseline) / raw_baseline
    return {
        "config": {"tokens": args.tokens, "budget": args.budget, "policy": args.policy, "warmup": args.warmup,
                   "sample_every": args.sample_every, "reply_tokens": args.reply_tokens, "threads": args.threads,
                   "max_growth": args.max_growth, "temperature": args.temperature, "seed": args.seed,
                   "model": os.path.basename(model),
                   "machine": f"{platform.machine()}, {os.cpu_count()} cpus", "command": " ".join(sys.argv)},
        "summary": {"generated": generated, "turns": turns, "tokens_seen": stats["tokens_seen"],
                    "tokens_evicted": stats["tokens_evicted"], "seconds": elapsed,
                    "tokens_per_second": generated / elapsed, "rss_at_warmup_bytes": baseline,
                    "rss_peak_after_warmup_bytes": peak, "rss_growth": growth, "raw_rss_growth": raw_growth,
                    "max_cells_used": max_cells,
                    "rss_ok": growth < args.max_growth, "cells_ok": max_cells <= args.budget,
                    "passed": growth < args.max_growth and max_cells <= args.budget},
        "samples": samples,
    }  # fmt: skip


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    config, summary, samples = report["config"], report["summary"], report["samples"]
    tokens = [s["tokens"] for s in samples]
    fig, (rss_axis, cells_axis) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
    rss_axis.plot(tokens, [s["rss_bytes"] / 2**20 for s in samples], marker=".", color="lightgrey", label="RSS")
    rss_axis.plot(tokens, [s["rss_live_bytes"] / 2**20 for s in samples], marker=".", label="live RSS")
    rss_axis.axhline(summary["rss_at_warmup_bytes"] * (1 + config["max_growth"]) / 2**20, color="red", linestyle=":",
                     label=f"live RSS after warm-up + {100 * config['max_growth']:g}%")
    rss_axis.set_ylabel("RSS (MiB)")
    rss_axis.legend(loc="lower right")
    cells_axis.plot(tokens, [s["cells_used"] for s in samples], marker=".", label="cells in use (sampled)")
    cells_axis.axhline(config["budget"], color="red", linestyle=":", label=f"budget {config['budget']}")
    cells_axis.set_ylim(0, config["budget"] * 1.15)
    cells_axis.set_ylabel("KV cells")
    cells_axis.set_xlabel("generated tokens")
    cells_axis.legend(loc="lower right")
    for axis in (rss_axis, cells_axis):
        axis.axvline(config["warmup"], color="grey", linestyle="--", linewidth=0.8)
    verdict = "PASS" if summary["passed"] else "FAIL"
    fig.suptitle(f"soak, {config['policy']} policy, budget {config['budget']}: live RSS growth "
                 f"{100 * summary['rss_growth']:.2f}%, max cells {summary['max_cells_used']} - {verdict}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", default=None, help="GGUF model (default: the bundled SmolLM2)")
    parser.add_argument("--tokens", type=int, default=100_000, help="tokens to generate")
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--policy", default="learned", help="learned (random weights), streaming, random or a path")
    parser.add_argument("--warmup", type=int, default=5_000, help="generated tokens before the RSS baseline")
    parser.add_argument("--sample-every", type=int, default=1_000)
    parser.add_argument("--reply-tokens", type=int, default=200, help="longest assistant reply")
    parser.add_argument("--max-growth", type=float, default=0.05, help="allowed RSS growth after the warm-up")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("--json", default="benchmarks/results/soak.json")
    parser.add_argument("--png", default="benchmarks/results/soak.png")
    args = parser.parse_args()

    report = run(args)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    plot(report, args.png)
    summary = report["summary"]
    print(f"{summary['generated']} tokens in {summary['turns']} turns, {summary['seconds']:.0f} s "
          f"({summary['tokens_per_second']:.1f} tok/s); live RSS {summary['rss_at_warmup_bytes'] / 2**20:.1f} MiB "
          f"after warm-up, peak {summary['rss_peak_after_warmup_bytes'] / 2**20:.1f} MiB "
          f"({100 * summary['rss_growth']:+.2f}%; raw RSS {100 * summary['raw_rss_growth']:+.2f}%); "
          f"max cells {summary['max_cells_used']} of {args.budget}: "
          f"{'PASS' if summary['passed'] else 'FAIL'}")
    print(f"wrote {args.json} and {args.png}")
    sys.exit(0 if summary["passed"] else 1)


if __name__ == "__main__":
    main()
