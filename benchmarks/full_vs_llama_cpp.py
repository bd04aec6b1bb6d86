"""Does kvp-bench's `full` reference score what plain llama-cpp-python scores on the same RULER samples?

    python benchmarks/full_vs_llama_cpp.py --tasks ruler-2k.jsonl --log sweep-2k.samples.jsonl [--samples 10]

For every sample that has a `full` record in the kvp-bench per-sample log (any variant: the full cache does not
compress), `llama_cpp.Llama` (not kvp_cpp's) generates greedily from `input + answer_prefix`, up to the sample's
`max_new_tokens`, and the prediction is scored with the same RULER metric (kvp_cpp.metrics). The table gives
both scores per task and their difference; the acceptance bound is 5 points. Predictions may differ in a few
samples: kvp-bench decodes the prompt's last token on its own (it is held back for compression), which changes
the floating-point summation order of that step, not the tokens the model sees.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import llama_cpp

from kvp_cpp import default_model_path
from kvp_cpp.metrics import score

BOUND = 5.0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", required=True, help="the RULER JSONL the kvp-bench run read")
    parser.add_argument("--log", required=True, help="the kvp-bench per-sample log (FILE.samples.jsonl)")
    parser.add_argument("-m", "--model", default=None, help="GGUF model (default: the embedded SmolLM2)")
    parser.add_argument("--samples", type=int, default=0, help="at most N samples per task (default: all logged)")
    parser.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("-o", "--output", default="full_vs_llama_cpp.json")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    model = args.model or default_model_path()
    with open(args.tasks, encoding="utf-8") as f:
        samples = {(r["task"], r["target_length"], r["index"]): r for r in map(json.loads, filter(str.strip, f))}
    full = {}
    with open(args.log, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # an interrupted last line
            if record.get("policy") == "full" and record.get("model") == os.path.basename(model):
                full.setdefault((record["task"], record["length"], record["index"]), record)
    taken = collections.Counter()
    keys = []
    for key in sorted(full, key=lambda k: (k[2], k[0], k[1])):
        if key in samples and (args.samples <= 0 or taken[key[:2]] < args.samples):
            taken[key[:2]] += 1
            keys.append(key)
    if not keys:
        raise SystemExit("no sample of the tasks file has a `full` record in the log")

    longest = max(len(samples[k]["input"]) for k in keys)  # characters: an upper bound on tokens
    llm = llama_cpp.Llama(model, n_ctx=min(longest + 256, 32768), n_batch=512, n_threads=args.threads,
                          verbose=False, seed=0)
    rows = collections.OrderedDict()
    start = time.time()
    for i, key in enumerate(keys):
        sample = samples[key]
        tokens = llm.tokenize((sample["input"] + sample["answer_prefix"]).encode("utf-8"), add_bos=True, special=True)
        llm.reset()
        out = llm.create_completion(tokens, max_tokens=sample["max_new_tokens"], temperature=0.0, top_k=1,
                                    repeat_penalty=1.0)
        prediction = out["choices"][0]["text"]
        python_score = score(sample["metric"], [prediction], [sample["outputs"]])
        row = rows.setdefault(key[:2], {"task": key[0], "length": key[1], "bench": [], "python": [], "same": 0})
        row["bench"].append(full[key]["score"])
        row["python"].append(python_score)
        row["same"] += prediction == full[key]["prediction"]
        print(f"[{i + 1}/{len(keys)} {time.time() - start:.0f}s] {key[0]} #{key[2]}: bench {full[key]['score']:.0f}"
              f" python {python_score:.0f}", file=sys.stderr)

    table = []
    for row in rows.values():
        n = len(row["bench"])
        bench_mean, python_mean = sum(row["bench"]) / n, sum(row["python"]) / n
        table.append({"task": row["task"], "length": row["length"], "n": n, "kvp_bench_full": round(bench_mean, 2),
                      "llama_cpp_python": round(python_mean, 2), "difference": round(bench_mean - python_mean, 2),
                      "identical_predictions": row["same"], "within_bound": abs(bench_mean - python_mean) <= BOUND})
    print("| task | length | n | kvp-bench full | llama_cpp.Llama | difference | identical predictions |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in table:
        print(f"| {r['task']} | {r['length']} | {r['n']} | {r['kvp_bench_full']:.2f} | {r['llama_cpp_python']:.2f} | "
              f"{r['difference']:+.2f} | {r['identical_predictions']}/{r['n']} |")
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump({"model": os.path.basename(model), "tasks": args.tasks, "log": args.log, "bound": BOUND,
                   "seconds": time.time() - start, "rows": table}, f, indent=2)
    return 0 if all(r["within_bound"] for r in table) else 1


if __name__ == "__main__":
    raise SystemExit(main())
