"""Which criterion of a kept set predicts the task score: the training target's, the attention output's, or the
model's own likelihood of the answer.

    python -m kvp_cpp.ruler --lengths 2048 --samples 10 --seed 7 --interleave -o all_2k_seed7.jsonl
    python benchmarks/kept_set_criteria.py --tasks all_2k_seed7.jsonl --budgets 128,512 \
        --policies kvp:kvp-recency.kvp.bin,keydiff --scores LOG1.samples.jsonl,LOG2.samples.jsonl -o criteria.json

Each sample's prompt (its input and answer prefix, as kvp-bench tokenizes it) is prefilled and all but its last
token compressed once to the budget by each policy (kvp-bench's oneshot protocol, question included), and each kept
set is measured three ways against the sample's gold answer, which is appended to the prompt (teacher forcing):
- ``lost``: the share of the attention that the last prompt token and the answer's tokens pay to the compressed
  tokens which falls on evicted ones (training.importance's target: causal softmax over the uncompressed sequence,
  llama.cpp's scale, max over the GQA group, summed over those queries), averaged over layers and KV heads: what
  the policies are trained to keep low, token by token;
- ``output``: the relative error ‖o_kept − o_full‖ / ‖o_full‖ of each layer's attention output at those queries
  when the evicted keys are masked out and the rest renormalised, averaged over layers, query heads and queries:
  a criterion of the kept set as a whole, still per layer and with the full run's queries;
- ``nll``: the mean negative log-likelihood of the answer's tokens when the model reads them from the compressed
  cache: the model's own, end-to-end verdict on the kept set (``nll_full``: the same from the full cache).
With ``--scores`` (kvp-bench per-sample logs of the same samples, policies, budgets and evict unit) each record gets
its task score, and the summary counts, over the pairs of policies whose scores differ on a (sample, budget), how
often each criterion is lower for the one that scored higher (``agree``; 0.5 is chance).
A diagnostic for the training objective, not a score: kvp-bench measures what the kept tokens are worth.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from typing import Dict, List, Optional, Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository, for training/
from training.importance import causal_attention, received as attention_received  # noqa: E402
from training.likelihood import decode_answer_nll  # noqa: E402

CRITERIA = ("lost", "output", "nll")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", required=True, help="RULER samples (python -m kvp_cpp.ruler), as for kvp-bench --tasks")
    p.add_argument("--policies", required=True,
                   help="comma-separated: kvp:PATH, a .kvp.bin path or a built-in policy (keydiff, knorm, ...)")
    p.add_argument("--budgets", required=True, help="comma-separated cells kept after the compression")
    p.add_argument("--samples", type=int, default=None, help="at most N samples per task (default all)")
    p.add_argument("--scores", default="", help="comma-separated kvp-bench .samples.jsonl logs to take scores from")
    p.add_argument("--evict-unit", default="word", choices=("word", "token"))
    p.add_argument("--model", default=None, help="GGUF model (default: the package's default model)")
    p.add_argument("-t", "--threads", type=int, default=1)
    p.add_argument("-o", "--output", help="write the records and the summary as JSON here (after every sample; a run "
                                          "resumes from it, skipping the samples it holds)")
    args = p.parse_args(argv)
    try:
        args.budgets = sorted({int(b) for b in args.budgets.split(",") if b.strip()})
    except ValueError:
        p.error(f"--budgets {args.budgets!r}: expected comma-separated integers")
    if not args.budgets or min(args.budgets) < 1:
        p.error("--budgets must be positive")
    return args


def policy_label(name: str) -> str:
    """A learned policy by its file name (kvp-bench run where the file is)."""
    return "kvp:" + os.path.basename(name[4:]) if name.startswith("kvp:") else name


def score_of(scores: Dict[tuple, float], name: str, sample: dict, budget: int) -> Optional[float]:
    """A policy's score on a sample from kvp-bench's records, which name it as given on kvp-bench's command line."""
    for label in (name, policy_label(name)):
        if (label, sample["task"], sample["index"], budget) in scores:
            return scores[(label, sample["task"], sample["index"], budget)]
    return None


def lost_share(importance: np.ndarray, kept: np.ndarray) -> float:
    """Mean over heads of the share of each head's (heads, n) importance that falls on tokens not kept."""
    totals = importance.sum(axis=-1)
    return float(np.mean(importance[:, ~kept].sum(axis=-1) / np.maximum(totals, 1e-300)))


def output_error(weights: np.ndarray, values: np.ndarray, visible: np.ndarray) -> float:
    """Mean relative error of the attention output when only ``visible`` keys remain, renormalised.

    weights: (m, n_head, n) causal attention of m queries over n keys (rows sum to 1); values: (n, n_head_kv, dv);
    visible: (n,) bool. Query head h reads KV head h // (n_head / n_head_kv)."""
    group = weights.shape[1] // values.shape[1]
    v = np.repeat(values.astype(np.float64), group, axis=1)                               # (n, n_head, dv)
    full = np.einsum("mhn,nhd->mhd", weights, v)
    masked = weights * visible[None, None, :]
    kept = np.einsum("mhn,nhd->mhd", masked / np.maximum(masked.sum(-1, keepdims=True), 1e-300), v)
    norms = np.maximum(np.linalg.norm(full, axis=-1), 1e-300)
    return float(np.mean(np.linalg.norm(kept - full, axis=-1) / norms))


def agreement(records: Sequence[dict], criteria: Sequence[str] = CRITERIA) -> Dict[str, Dict[str, object]]:
    """Per task (and "all"): over every pair of records of the same sample and budget whose scores differ, the
    share where the criterion is lower for the higher score (ties in the criterion count half)."""
    groups: Dict[tuple, List[dict]] = {}
    for r in records:
        if r.get("score") is not None:
            groups.setdefault((r["task"], r["index"], r["budget"]), []).append(r)
    tally: Dict[str, Dict[str, List[float]]] = {}
    for (task, _, _), group in groups.items():
        for a, b in itertools.combinations(group, 2):
            if a["score"] == b["score"]:
                continue
            better, worse = (a, b) if a["score"] > b["score"] else (b, a)
            for name in criteria:
                verdict = 1.0 if better[name] < worse[name] else 0.5 if better[name] == worse[name] else 0.0
                for key in (task, "all"):
                    tally.setdefault(key, {}).setdefault(name, []).append(verdict)
    return {key: {"pairs": len(next(iter(by.values()))), **{name: float(np.mean(v)) for name, v in by.items()}}
            for key, by in tally.items()}


def means(records: Sequence[dict]) -> List[dict]:
    """Mean score and criteria per (task, budget, policy)."""
    groups: Dict[tuple, List[dict]] = {}
    for r in records:
        groups.setdefault((r["task"], r["budget"], r["policy"]), []).append(r)
    rows = []
    for (task, budget, policy), group in groups.items():
        scores = [r["score"] for r in group if r.get("score") is not None]
        rows.append({"task": task, "budget": budget, "policy": policy, "samples": len(group),
                     "score": float(np.mean(scores)) if len(scores) == len(group) else None,
                     **{name: float(np.mean([r[name] for r in group])) for name in CRITERIA + ("nll_full",)}})
    return rows


def load_scores(paths: Sequence[str], evict_unit: str) -> Dict[tuple, float]:
    scores = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                r = json.loads(line) if line.strip() else None
                if r and r.get("kv_mode", "shared") == "shared" and r.get("evict_unit", "token") == evict_unit \
                        and r.get("sink") is None and r.get("stretch") is None:
                    scores[(r["policy"], r["task"], r["index"], r["budget"])] = r["score"]
    return scores


def run(args: argparse.Namespace) -> Dict[str, object]:
    from kvp_cpp import Llama, default_model_path
    from kvp_cpp.capture import TensorCapture
    from tqdm import tqdm

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kept_profile import compressed_once, load_samples, policy_argument

    samples = load_samples(args.tasks, args.samples)
    if not samples:
        raise SystemExit(f"{args.tasks}: no samples")
    policies = [p for p in args.policies.split(",") if p]
    scores = load_scores([p for p in args.scores.split(",") if p], args.evict_unit)
    model = args.model or default_model_path()
    vocab = Llama(model, n_ctx=64, vocab_only=True, verbose=False)
    prompts = [vocab.tokenize((s["input"] + s.get("answer_prefix", "")).encode(), add_bos=False, special=True)
               for s in samples]
    answers = [vocab.tokenize((" " + ", ".join(s["outputs"])).encode(), add_bos=False, special=False) for s in samples]
    for sample, tokens in zip(samples, prompts):
        if len(tokens) - 1 <= max(args.budgets):
            raise SystemExit(f"sample {sample['task']} #{sample['index']}: its {len(tokens)} tokens fit the budget "
                             f"{max(args.budgets)}; nothing would be evicted")
    n_ctx = max(len(p) + len(a) for p, a in zip(prompts, answers)) + 8
    capture = TensorCapture(model, n_ctx=n_ctx, n_threads=args.threads)
    full = Llama(model, n_ctx=n_ctx, n_threads=args.threads, verbose=False)
    engines = {name: Llama(model, n_ctx=n_ctx, kv_policy=policy_argument(name), kv_evict_unit=args.evict_unit,
                           n_threads=args.threads, kv_threads=args.threads, verbose=False)
               for name in policies}

    records = []
    if args.output and os.path.exists(args.output):
        with open(args.output) as f:
            previous = json.load(f)
        if (previous["policies"], previous["budgets"], previous["evict_unit"]) != (policies, args.budgets,
                                                                                  args.evict_unit):
            raise SystemExit(f"{args.output} holds another run (policies, budgets or evict unit); not resuming it")
        records = previous["records"]
    done = {(r["task"], r["index"]) for r in records}
    for sample, prompt, answer in tqdm(list(zip(samples, prompts, answers)), desc="samples", file=sys.stderr):
        if (sample["task"], sample["index"]) in done:
            continue
        sequence, context = prompt + answer, len(prompt) - 1
        out = capture.run(sequence)
        layers = sorted(out["Kcur"])
        # llama.cpp multiplies f16 Q with its f16 cache, as in training.capture_traces
        q = {layer: out["Qcur"][layer].astype(np.float16) for layer in layers}
        k = {layer: out["Kcur"][layer].astype(np.float16) for layer in layers}
        values = {layer: out["Vcur"][layer].astype(np.float16) for layer in layers}
        scale = 1.0 / np.sqrt(k[layers[0]].shape[-1])
        weights = {layer: causal_attention(q[layer][context:], k[layer], scale, context) for layer in layers}
        received = {layer: attention_received(weights[layer][:, :, :context], k[layer].shape[1]) for layer in layers}
        full.reset()
        full.eval(prompt[:-1])
        nll_full = decode_answer_nll(full, prompt[-1:] + answer[:-1], answer)
        for budget in args.budgets:
            for name, llm in engines.items():
                kept = compressed_once(llm, prompt[:-1], budget, n_ctx)
                llm.kv_set_budget(n_ctx)  # the answer after the compression must not evict either
                visible = np.concatenate([kept, np.ones(len(sequence) - context, bool)])
                records.append({
                    "task": sample["task"], "index": sample["index"], "budget": budget, "policy": name,
                    "score": score_of(scores, name, sample, budget),
                    "kept": int(kept.sum()),
                    "lost": float(np.mean([lost_share(received[layer], kept) for layer in layers])),
                    "output": float(np.mean([output_error(weights[layer], values[layer], visible)
                                             for layer in layers])),
                    "nll": decode_answer_nll(llm, prompt[-1:] + answer[:-1], answer), "nll_full": nll_full})
        if args.output:
            write_json(args.output, result_of(args, policies, records))
    capture.close()
    return result_of(args, policies, records)


def result_of(args: argparse.Namespace, policies: List[str], records: List[dict]) -> Dict[str, object]:
    return {"tasks": args.tasks, "policies": policies, "budgets": args.budgets, "evict_unit": args.evict_unit,
            "scores": args.scores, "records": records, "means": means(records), "agreement": agreement(records)}


def write_json(path: str, result: Dict[str, object]) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)  # a run stopped while writing keeps the previous file


def print_tables(result: Dict[str, object]) -> None:
    def number(x: Optional[float], digits: int = 3) -> str:
        return "-" if x is None else f"{x:.{digits}f}"

    print("| task | budget | policy | score | lost | output | nll (full cache) |")
    print("|---|---|---|---|---|---|---|")
    for row in sorted(result["means"], key=lambda r: (r["task"], r["budget"], r["policy"])):
        print(f"| {row['task']} | {row['budget']} | {row['policy']} | {number(row['score'], 1)} | "
              f"{number(row['lost'])} | {number(row['output'])} | {number(row['nll'])} ({number(row['nll_full'])}) |")
    if result["agreement"]:
        print()
        print("| task | pairs with different scores | lost agrees | output agrees | nll agrees |")
        print("|---|---|---|---|---|")
        for task, row in sorted(result["agreement"].items(), key=lambda kv: (kv[0] == "all", kv[0])):
            print(f"| {task} | {row['pairs']} | " + " | ".join(f"{row[name]:.2f}" for name in CRITERIA) + " |")


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    result = run(args)
    print_tables(result)
    if args.output:
        write_json(args.output, result)


if __name__ == "__main__":
    main()
