"""Where in the prompt each policy keeps its tokens: the kept share per tenth of the prompt, and of the answer's tokens.

    python -m kvp_cpp.ruler --tasks fwe --lengths 2048 --samples 40 --seed 7 -o fwe_2k_seed7.jsonl
    python benchmarks/kept_profile.py --tasks fwe_2k_seed7.jsonl --samples 10 --budget 512 \
        --policies kvp:models/smollm2-135m-instruct.kvp.bin,keydiff,knorm -o kept_profile_fwe_512.json
    python benchmarks/kept_profile.py --traces traces-smollm2 --documents fwe --kept 0.25 \
        --policies models/smollm2-135m-instruct.kvp.bin -o kept_profile_fwe_traces.json

With --tasks, each sample's prompt is prefilled whole and compressed once to the budget (kvp-bench's oneshot
protocol, question included), and the engine's ledger says which prompt positions are still cached. Reported per
policy and task, averaged over the samples:
- ``deciles``: the share of each tenth of the prompt that is kept (a streaming cache keeps the last tenths whole);
- ``run``: the mean length of the runs of consecutive kept tokens (whole stretches of text, or scattered tokens);
- ``answer``: the share kept of the prompt tokens that spell one of the sample's gold ``outputs`` where it occurs
  in the prompt (the needle's digits, fwe's frequent words, vt's variable names), and ``other`` the share of the
  rest, so that a policy that keeps what the answer needs shows ``answer`` above ``other``;
- ``counted`` (the counting tasks fwe and cwe, whose answer is the text's most frequent words): the share of the
  gold words among the most frequent words of what is kept, counting a word's occurrences that are kept whole, so
  1.0 when the kept tokens still rank the words as the text does; ``answer whole`` and ``other whole`` the share of
  the gold words' occurrences and of the other words' kept whole.
With --traces (training traces, docs/traces.md), the same shares per tenth for the tokens a learned policy keeps and
for those its training target, the importance, would keep (the oracle), at a kept fraction of each cached prefix's
rankable tokens (past the policy's sinks, before its recent tokens), in both modes: per head (the mean over heads of
each head's top tokens) and shared (one set, by the sum over heads of each head's softmax of scores, or of its share
of the importance, as training.evaluate combines them). ``attention`` is each tenth's part of the heads' summed
shares of the importance, times ten (1.0 everywhere for attention spread evenly). Prefixes are grouped by their
cut: ``window`` (the next n_future queries) or ``anchored`` (the rest of the sequence: the question and the answer
of a RULER sample).
A diagnostic, not a score: kvp-bench measures what the kept tokens are worth.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository, for training/
from training import evaluate  # noqa: E402

N_DECILES = 10
COUNTING_TASKS = ("fwe", "cwe")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--tasks", help="RULER samples (python -m kvp_cpp.ruler), as for kvp-bench --tasks")
    source.add_argument("--traces", help="a training-trace directory: the policy against its target's oracle")
    p.add_argument("--policies", required=True,
                   help="comma-separated: kvp:PATH, a .kvp.bin path or a built-in policy (keydiff, knorm, streaming, "
                        "...); with --traces, one learned policy")
    p.add_argument("--budget", type=int, help="--tasks: cells kept after the compression")
    p.add_argument("--kept", type=float, default=0.25, help="--traces: the kept fraction of the rankable tokens")
    p.add_argument("--documents", help="--traces: only sequences whose document name starts with one of these "
                                       "comma-separated prefixes (fwe, niah_single_1, chat, ...)")
    p.add_argument("--samples", type=int, default=None, help="at most N samples per task (default all)")
    p.add_argument("--combine", default="sum_softmax", help="per-head score combination (kv_head_combine)")
    p.add_argument("--evict-unit", default="word", choices=("word", "token"))
    p.add_argument("--sink", type=int, default=None, help="--tasks: first tokens never evicted (default: the "
                                                          "policy's, as kv_sink)")
    p.add_argument("--model", default=None, help="GGUF model (default: the package's default model)")
    p.add_argument("-t", "--threads", type=int, default=1)
    p.add_argument("-o", "--output", help="write the profile as JSON here")
    return p.parse_args(argv)


def policy_argument(name: str) -> str:
    return name[4:] if name.startswith("kvp:") else name


def piece_ends(pieces: Sequence[bytes]) -> np.ndarray:
    """The byte offset where each token's piece ends in the concatenated pieces."""
    return np.cumsum([len(p) for p in pieces])


def answer_mask(pieces: Sequence[bytes], outputs: Sequence[str]) -> np.ndarray:
    """True for the tokens whose bytes overlap an occurrence of one of ``outputs`` in the concatenated pieces."""
    ends = piece_ends(pieces)
    starts = ends - np.array([len(p) for p in pieces])
    text = b"".join(pieces)
    mask = np.zeros(len(pieces), bool)
    for output in outputs:
        needle = output.encode()
        if not needle:
            continue
        at = text.find(needle)
        while at >= 0:
            mask |= (starts < at + len(needle)) & (ends > at)
            at = text.find(needle, at + 1)
    return mask


def prompt_words(pieces: Sequence[bytes], end: Optional[int] = None) -> List[Tuple[str, int, int]]:
    """The words of the first ``end`` tokens as (word, first token, end token): a token of a space and letters with
    the letter-only tokens that follow it (fwe's coded words are one to three tokens)."""
    text = [p.decode("utf-8", "replace") for p in pieces[:end]]
    words, i = [], 0
    while i < len(text):
        j = i + 1
        if text[i][:1] == " " and text[i][1:].isascii() and text[i][1:].isalpha():
            while j < len(text) and text[j].isascii() and text[j].isalpha():
                j += 1
            words.append(("".join(text[i:j]).strip(), i, j))
        i = j
    return words


def counted_profile(kept: np.ndarray, words: Sequence[Tuple[str, int, int]], outputs: Sequence[str]) -> Dict:
    """How far the kept tokens keep a counting task's answer: its words among the most frequent of those kept
    whole, and the share of its words' occurrences, and of the others', kept whole."""
    whole = np.array([kept[i:j].all() for _, i, j in words], bool)
    counts = Counter(word for (word, _, _), w in zip(words, whole) if w)
    gold = set(outputs)
    top = [word for word, _ in counts.most_common(len(gold))]
    is_gold = np.array([word in gold for word, _, _ in words], bool)
    return {"counted": sum(word in gold for word in top) / len(gold),
            "answer whole": float(whole[is_gold].mean()) if is_gold.any() else None,
            "other whole": float(whole[~is_gold].mean()) if (~is_gold).any() else None}


def question_start(sample: dict, pieces: Sequence[bytes]) -> Optional[int]:
    """The first token of the sample's question (the prompt's tail after its text), or None if it has none."""
    question = sample.get("question") or ""
    if not question or not sample["input"].endswith(question):
        return None
    at = len(sample["input"][:-len(question)].encode())
    return int(np.searchsorted(piece_ends(pieces), at, side="right"))


def mean_run(kept: np.ndarray) -> float:
    """The mean length of the maximal runs of consecutive kept tokens."""
    edges = np.diff(np.concatenate([[0], kept.astype(np.int8), [0]]))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return float(np.mean(ends - starts)) if starts.size else 0.0


def kept_profile(kept: np.ndarray, answer: np.ndarray) -> Dict[str, object]:
    return {
        "deciles": deciles(kept),
        "run": mean_run(kept),
        "answer": float(kept[answer].mean()) if answer.any() else None,
        "other": float(kept[~answer].mean()),
    }


def mean_profile(profiles: Sequence[Dict[str, object]]) -> Dict[str, object]:
    def mean_of(name: str) -> Optional[float]:
        values = [p[name] for p in profiles if p.get(name) is not None]
        return float(np.mean(values)) if values else None

    profile = {
        "samples": len(profiles),
        "deciles": [float(x) for x in np.mean([p["deciles"] for p in profiles], axis=0)],
        "run": float(np.mean([p["run"] for p in profiles])),
        "answer": mean_of("answer"),
        "other": float(np.mean([p["other"] for p in profiles])),
    }
    if any("counted" in p for p in profiles):
        profile.update({name: mean_of(name) for name in ("counted", "answer whole", "other whole")})
    return profile


def load_samples(path: str, per_task: Optional[int]) -> List[dict]:
    samples, seen = [], {}
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            sample = json.loads(line)
            key = (sample["task"], sample.get("target_length", sample.get("length")))  # "length" is the actual one
            if per_task is not None and seen.get(key, 0) >= per_task:
                continue
            seen[key] = seen.get(key, 0) + 1
            samples.append(sample)
    return samples


def compressed_once(llm, tokens: Sequence[int], budget: int, n_ctx: int) -> np.ndarray:
    """Prefill ``tokens`` from an empty cache and compress them once to ``budget`` (kvp-bench's oneshot protocol);
    returns which of them are still cached. The compression's budget stays in force afterwards."""
    llm.reset()
    llm.kv_set_budget(n_ctx)  # kv_compress keeps its budget from then on: the prefill must not evict
    llm.eval(list(tokens))
    llm.kv_compress(budget)
    kept = np.zeros(len(tokens), bool)
    kept[np.asarray(llm.kv_engine.ledger()["logical"], dtype=np.int64)] = True
    return kept


def run(args: argparse.Namespace) -> Dict[str, object]:
    from kvp_cpp import Llama, default_model_path

    try:
        from tqdm import tqdm
    except ImportError:  # the progress bar is optional
        def tqdm(iterable, **_):
            return iterable

    samples = load_samples(args.tasks, args.samples)
    if not samples:
        raise SystemExit(f"{args.tasks}: no samples")
    policies = [p for p in args.policies.split(",") if p]
    model = args.model or default_model_path()
    vocab = Llama(model, n_ctx=64, vocab_only=True, verbose=False)
    prompts = [vocab.tokenize(s["input"].encode(), add_bos=False, special=True) for s in samples]
    pieces = [[vocab.detokenize([t], special=True) for t in tokens] for tokens in prompts]
    for sample, tokens in zip(samples, prompts):
        if len(tokens) <= args.budget:
            raise SystemExit(f"sample {sample['task']} #{sample['index']}: its {len(tokens)} tokens fit the budget "
                             f"{args.budget}; nothing would be evicted")
    result: Dict[str, object] = {"tasks": args.tasks, "budget": args.budget, "combine": args.combine,
                                 "evict_unit": args.evict_unit, "sink": args.sink, "policies": {}}
    n_ctx = max(map(len, prompts))
    for name in policies:
        llm = Llama(model, n_ctx=n_ctx, kv_policy=policy_argument(name), kv_head_combine=args.combine,
                    kv_evict_unit=args.evict_unit, kv_sink=args.sink, n_threads=args.threads, kv_threads=args.threads,
                    verbose=False)
        by_task: Dict[str, List[Dict[str, object]]] = {}
        for sample, tokens, sample_pieces in tqdm(list(zip(samples, prompts, pieces)), desc=name, file=sys.stderr):
            kept = compressed_once(llm, tokens, args.budget, n_ctx)
            answer = answer_mask(sample_pieces, sample["outputs"])
            profile = kept_profile(kept, answer)
            if sample["task"] in COUNTING_TASKS:
                words = prompt_words(sample_pieces, question_start(sample, sample_pieces))
                profile.update(counted_profile(kept, words, sample["outputs"]))
            by_task.setdefault(sample["task"], []).append(profile)
        llm.close()
        result["policies"][name] = {task: mean_profile(profiles) for task, profiles in by_task.items()}
    return result


def top_mask(scores: np.ndarray, k: int) -> np.ndarray:
    kept = np.zeros(scores.shape[-1], bool)
    kept[np.argsort(-scores, kind="stable")[:k]] = True
    return kept


def deciles(values: np.ndarray) -> List[float]:
    return [float(part.mean()) for part in np.array_split(values, N_DECILES)]


def prefix_profile(importance: Sequence[np.ndarray], scores: Sequence[np.ndarray], kept_fraction: float) -> Dict:
    """Shares kept per tenth of one prefix's rankable tokens, given per layer the (heads, tokens) importance and
    policy scores of those tokens: oracle and policy, per head and shared, and where the attention goes."""
    n = importance[0].shape[-1]
    k = max(1, int(round(kept_fraction * n)))
    share = sum((layer / np.maximum(layer.sum(axis=-1, keepdims=True), 1e-30)).sum(axis=0) for layer in importance)
    softmax = sum(evaluate.softmax(layer).sum(axis=0) for layer in scores)
    per_head = {name: np.mean([deciles(top_mask(row, k)) for layer in ranked for row in layer], axis=0)
                for name, ranked in (("oracle", importance), ("policy", scores))}
    return {
        "attention": [10 * float(x) for x in np.array([part.sum() for part in np.array_split(share, N_DECILES)])
                      / share.sum()],
        "oracle per head": [float(x) for x in per_head["oracle"]],
        "policy per head": [float(x) for x in per_head["policy"]],
        "oracle shared": deciles(top_mask(share, k)),
        "policy shared": deciles(top_mask(softmax, k)),
    }


def run_traces(args: argparse.Namespace) -> Dict[str, object]:
    from kvp_cpp import policy_file
    from training.traces import TraceSet

    policies = [p for p in args.policies.split(",") if p]
    if len(policies) != 1:
        raise SystemExit("--traces compares one learned policy with its target: give one .kvp.bin in --policies")
    if not 0 < args.kept < 1:
        raise SystemExit(f"--kept {args.kept}: a kept fraction is between 0 and 1")
    traces = TraceSet(args.traces)
    policy = policy_file.read_policy(policy_argument(policies[0]))
    layers = evaluate.scored_layers(policy, traces)
    score = evaluate.policy_score_fn(policy)
    prefixes = [p.strip() for p in (args.documents or "").split(",") if p.strip()]
    groups: Dict[str, List[Dict]] = {}
    for index, info in enumerate(traces.sequences):
        if prefixes and not any(info.document.startswith(prefix) for prefix in prefixes):
            continue
        futures = dict(zip(info.cuts, info.futures)) if info.futures else {}
        for cut in info.cuts:
            rankable = slice(policy.n_sink, cut - policy.n_recent)
            if rankable.stop - rankable.start < N_DECILES:
                continue
            future = futures.get(cut, traces.n_future)
            kind = "anchored" if cut + future == info.n_tokens and future != traces.n_future else "window"
            layer_traces = traces.read_prefix(index, cut, layers)
            groups.setdefault(kind, []).append(prefix_profile(
                [t.importance[:, rankable].astype(np.float64) for t in layer_traces],
                [np.asarray(score(t), np.float64)[:, rankable] for t in layer_traces], args.kept))
    if not groups:
        raise SystemExit(f"{args.traces}: no prefixes of documents {args.documents or '(any)'}")
    return {"traces": args.traces, "policy": policies[0], "kept": args.kept, "documents": args.documents,
            "prefixes": {kind: {"count": len(profiles), **{name: [float(x) for x in np.mean(
                [p[name] for p in profiles], axis=0)] for name in profiles[0]}} for kind, profiles in groups.items()}}


def print_markdown(first_columns: Sequence[str], rows: Sequence[Sequence[str]],
                   last_columns: Sequence[str] = ()) -> None:
    tenths = [f"{10 * i}-{10 * i + 10}%" for i in range(N_DECILES)]
    columns = list(first_columns) + tenths + list(last_columns)
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def print_trace_table(result: Dict[str, object]) -> None:
    print_markdown(["cut", "prefixes", "ranking"], [
        [kind, str(entry["count"]), name] + [f"{x:.2f}" for x in values]
        for kind, entry in result["prefixes"].items() for name, values in entry.items() if name != "count"])


def print_table(result: Dict[str, object]) -> None:
    counting = ("counted", "answer whole", "other whole")
    has_counts = any("counted" in p for tasks in result["policies"].values() for p in tasks.values())

    def number(x: Optional[float]) -> str:
        return "-" if x is None else f"{x:.2f}"

    print_markdown(["policy", "task"], [
        [policy, task] + [f"{x:.2f}" for x in p["deciles"]] +
        [number(p["answer"]), f"{p['other']:.2f}", f"{p['run']:.1f}"] +
        ([number(p.get(name)) for name in counting] if has_counts else [])
        for policy, tasks in result["policies"].items() for task, p in tasks.items()],
        ["answer", "other", "run"] + (list(counting) if has_counts else []))


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    if args.traces:
        result = run_traces(args)
        print_trace_table(result)
    else:
        if args.budget is None:
            raise SystemExit("--tasks needs --budget")
        result = run(args)
        print_table(result)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
