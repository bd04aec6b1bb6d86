"""Held-out evaluation of an eviction policy against attention-free baselines and the oracle.

    python -m training.evaluate --traces traces-smollm2 --policy policy.kvp.bin --json eval.json --plot eval.png

For every held-out prefix, (layer, KV head) and budget fraction b, the eviction cost C_b is the importance of the
rankable tokens evicted when only the top round(b·n) of them are kept (the first n_sink and last n_recent tokens are
never ranked, as at inference). A method's normalised cost for a (layer, head, b) is Σ C_b / Σ C_b(σ*) over the
prefixes (a ratio of sums: single prefixes with a near-zero optimal cost would dominate a mean of ratios); the
oracle σ* sorts by importance, so its normalised cost is 1. The per-head numbers are averaged over heads.

Methods: "kvp" (the policy, scored by the runtime's kvp_cpp.Scorer), "random", "streaming" (keep the most recent),
"knorm" (keep the lowest key L2 norm), "keydiff" and "lagkv" (the runtime's policies through the ranking view) and
"oracle". Two modes: "per_head" ranks each head by its own scores;
"shared" keeps one token set for every head of every layer, ranked by Σ over heads of the per-head softmax over
tokens (the runtime's sum_softmax head combination), and reports the cost of that ranking for each head.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Callable, Optional, Sequence

import numpy as np

import kvp_cpp
from kvp_cpp import policy_file as pf

from .traces import LayerTrace, TraceSet, comma_names

__all__ = [
    "BUDGETS", "BASELINES", "MODES", "baseline_scores", "evicted_importance", "softmax", "policy_score_fn", "evaluate", "summary",
    "plot", "print_table", "scored_layers", "rankable_prefixes",
]  # fmt: skip

BUDGETS = tuple(round(0.1 * i, 1) for i in range(1, 10))
BASELINES = ("random", "streaming", "knorm", "keydiff", "lagkv")
# Scored by the runtime's own policy objects through the ranking view (kvp_cpp._core.policy_ranking), so the
# evaluation ranks exactly as the engine would; tova and snapkv need the queries of the prefix's last tokens, which
# traces do not store (only K and V, the agents' inputs, plus a small verification slice of Q).
RANKING_VIEW_BASELINES = ("keydiff", "lagkv")
MODES = ("per_head", "shared")
DEFAULT_SINK, DEFAULT_RECENT = 4, 16


def baseline_scores(method: str, trace: LayerTrace, rng: np.random.Generator, identity: Optional[dict] = None,
                    n_sink: int = DEFAULT_SINK, n_recent: int = DEFAULT_RECENT) -> np.ndarray:
    """(H, c) keep-scores of an attention-free baseline (or the oracle) for every token of a prefix. keydiff and
    lagkv need the model identity of the traces (TraceSet.identity())."""
    n_head, n_tokens = trace.importance.shape
    if method == "random":
        return rng.random((n_head, n_tokens))
    if method == "streaming":
        return np.broadcast_to(trace.positions.astype(np.float64), (n_head, n_tokens))
    if method == "knorm":
        return -np.linalg.norm(trace.k.astype(np.float64), axis=-1)
    if method in RANKING_VIEW_BASELINES:
        k = np.ascontiguousarray(trace.k.transpose(1, 0, 2), dtype=np.float32)
        v = np.ascontiguousarray(trace.v.transpose(1, 0, 2), dtype=np.float32)
        positions = np.ascontiguousarray(trace.positions, dtype=np.int64)
        ranked = kvp_cpp._core.policy_ranking(method, identity, trace.layer, k, v, None, positions, n_sink, n_recent)
        return np.asarray(ranked["scores"], dtype=np.float64)
    if method == "oracle":
        # log importance: its per-head softmax is the normalised importance, which the shared mode then sums.
        return np.log(np.maximum(trace.importance.astype(np.float64), np.finfo(np.float64).tiny))
    raise ValueError(f"unknown method {method!r}")


def importance_by_score(importance: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """(H, n) each head's importance in the order of its ranking by score, descending (ties: earlier token first)."""
    order = np.argsort(-scores, axis=-1, kind="stable")
    return np.take_along_axis(importance.astype(np.float64), order, axis=-1)


def _evicted(ordered: np.ndarray, budgets: Sequence[float]) -> np.ndarray:
    kept = np.cumsum(ordered, axis=-1)
    total = kept[:, -1:]
    n = ordered.shape[-1]
    n_kept = np.array([int(round(b * n)) for b in budgets])
    kept_at = np.where(n_kept > 0, kept[:, np.maximum(n_kept - 1, 0)], 0.0)
    return total - kept_at


def _cost(ordered: np.ndarray) -> np.ndarray:
    return ordered @ np.arange(ordered.shape[-1], dtype=np.float64)


def _reward(cost: np.ndarray, best: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(best > 0, -cost / best, np.nan)


def evicted_importance(importance: np.ndarray, scores: np.ndarray, budgets: Sequence[float]) -> np.ndarray:
    """(H, B) importance evicted from each head's n tokens when the top round(b·n) by score are kept."""
    return _evicted(importance_by_score(importance, scores), budgets)


def ranking_cost(importance: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """(H,) C(σ) = Σ_r (r−1)·I(σ_r) of each head's ranking σ by score: the importance evicted summed over every
    budget. C(σ*), the oracle's, is ranking_cost(importance, importance)."""
    return _cost(importance_by_score(importance, scores))


def ranking_reward(importance: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """(H,) −C(σ)/C(σ*) of each head's ranking by score, the RL trainer's reward (training.rl.normalised_rewards) of
    the greedy ranking. NaN where C(σ*) = 0 (at most one token has importance)."""
    return _reward(ranking_cost(importance, scores), ranking_cost(importance, importance))


def softmax(scores: np.ndarray) -> np.ndarray:
    """Softmax over the last axis (each head's scores over its tokens)."""
    shifted = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def policy_score_fn(policy: pf.PolicyData) -> Callable[[LayerTrace], np.ndarray]:
    """(H, c) scores of a policy by the runtime's scorer, on exactly the bytes a kvp.bin of it holds, plus its
    recency term at the prefix's end (what the evictor ranks by when the cache holds tokens 0 … c−1)."""
    scorer = kvp_cpp.Scorer(kvp_cpp.parse_policy(pf.encode_policy(policy)), n_threads=1)

    def score(trace: LayerTrace) -> np.ndarray:
        k = np.ascontiguousarray(trace.k.transpose(1, 0, 2))
        v = np.ascontiguousarray(trace.v.transpose(1, 0, 2))
        scores = scorer.score_layer(trace.layer, k, v, trace.positions).T
        if policy.recency:
            scores = (scores + pf.recency_terms(policy, trace.layer, trace.cut - trace.positions).T).astype(np.float32)
        return scores

    return score


def scored_layers(policy: pf.PolicyData, traces: TraceSet) -> list:
    """The layers the policy scores, once it is known to be a policy for the traces' model."""
    if policy.identity() != traces.identity():
        raise ValueError(f"policy identity {policy.identity()} does not match the traces' {traces.identity()}")
    return [layer for layer in range(policy.n_layer) if policy.layer_scored[layer]]


def rankable_prefixes(traces: TraceSet, split: str, sources: Optional[Sequence[str]], n_protected: int,
                      min_cut: int = 0, max_prefixes: Optional[int] = None) -> list:
    """(sequence, cut) of a split's prefixes (of the given sources, if not None) that leave tokens to rank past the
    n_protected the evictor never ranks, and hold at least min_cut tokens; the first max_prefixes of them."""
    chosen = set(traces.sequences_of(split, sources))
    prefixes = [(i, cut) for i, cut in traces.prefixes(split) if i in chosen and cut > n_protected and cut >= min_cut]
    return prefixes[:max_prefixes]


def evaluate(
    traces: TraceSet,
    policy: Optional[pf.PolicyData] = None,
    *,
    split: str = "heldout",
    layers: Optional[Sequence[int]] = None,
    max_prefixes: Optional[int] = None,
    min_cut: int = 0,
    seed: int = 0,
    sources: Optional[Sequence[str]] = None,
) -> dict:
    """Normalised eviction costs of the policy (if given), the baselines and the oracle on one split (of the given
    trace sources only, if sources is not None)."""
    if policy is not None:
        n_sink, n_recent = policy.n_sink, policy.n_recent
        scored = scored_layers(policy, traces)
        layers = scored if layers is None else [layer for layer in layers if layer in scored]
    else:
        n_sink, n_recent = DEFAULT_SINK, max(DEFAULT_RECENT, traces.sliding_window)
        layers = traces.global_layers if layers is None else list(layers)
    prefixes = rankable_prefixes(traces, split, sources, n_sink + n_recent, min_cut, max_prefixes)
    if not prefixes or not layers:
        raise ValueError(f"nothing to evaluate: {len(prefixes)} prefixes of split {split!r}, layers {layers}")

    methods = (["kvp"] if policy is not None else []) + list(BASELINES) + ["oracle"]
    score_kvp = policy_score_fn(policy) if policy is not None else None
    rng = np.random.default_rng(seed)
    shape = (len(layers), traces.n_head_kv, len(BUDGETS))
    evicted = {mode: {method: np.zeros(shape) for method in methods} for mode in MODES}
    optimal = np.zeros(shape)
    rewards = {method: [] for method in methods}

    for index, cut in prefixes:
        rankable = slice(n_sink, cut - n_recent)
        layer_traces = traces.read_prefix(index, cut, layers)
        importance = [t.importance[:, rankable] for t in layer_traces]
        combined = {method: 0.0 for method in methods}
        for slot, trace in enumerate(layer_traces):
            # one sort per ranking serves both the per-budget costs and the RL reward
            by_importance = importance_by_score(importance[slot], importance[slot])
            optimal[slot] += _evicted(by_importance, BUDGETS)
            best = _cost(by_importance)
            for method in methods:
                scores = (score_kvp(trace) if method == "kvp" else
                          baseline_scores(method, trace, rng, traces.identity(), n_sink, n_recent))
                scores = np.asarray(scores, dtype=np.float64)[:, rankable]
                ordered = importance_by_score(importance[slot], scores)
                evicted["per_head"][method][slot] += _evicted(ordered, BUDGETS)
                rewards[method].append(_reward(_cost(ordered), best))
                combined[method] = combined[method] + softmax(scores).sum(axis=0)
        for method in methods:
            for slot in range(len(layers)):
                shared = np.broadcast_to(combined[method], importance[slot].shape)
                evicted["shared"][method][slot] += evicted_importance(importance[slot], shared, BUDGETS)

    result = {
        "split": split,
        "sources": None if sources is None else list(sources),
        "n_prefixes": len(prefixes),
        "prefix_lengths": [cut for _, cut in prefixes],
        "n_sink": n_sink,
        "n_recent": n_recent,
        "budgets": list(BUDGETS),
        "layers": list(layers),
        "methods": methods,
    }
    for mode in MODES:
        result[mode] = {}
        for method in methods:
            with np.errstate(divide="ignore", invalid="ignore"):
                # Nothing evicted where nothing could be: 1; something evicted where nothing had to be: undefined.
                ratio = np.where(optimal > 0, evicted[mode][method] / optimal,
                                 np.where(evicted[mode][method] > 0, np.nan, 1.0))  # fmt: skip
            mean = np.nanmean(ratio.reshape(-1, len(BUDGETS)), axis=0)
            result[mode][method] = {
                "cost": _json_floats(ratio),
                "mean": _json_floats(mean),
                "mean_over_budgets": _json_floats(np.nanmean(mean)),
            }
    for method in methods:
        result["per_head"][method]["reward"] = _json_floats(np.nanmean(np.concatenate(rewards[method])))
    return result


def _json_floats(values):
    """Nested lists of floats (NaN → None, which JSON can hold)."""
    array = np.asarray(values, dtype=np.float64)
    if array.ndim == 0:
        value = float(array)
        return None if math.isnan(value) else round(value, 6)
    return [_json_floats(row) for row in array]


def summary(result: dict) -> dict:
    """The head-averaged curves of every method and mode, for a policy file's metadata."""
    return {
        "split": result["split"],
        "n_prefixes": result["n_prefixes"],
        "budgets": result["budgets"],
        **{
            mode: {method: {k: v for k, v in entry.items() if k != "cost"} for method, entry in result[mode].items()}
            for mode in MODES
        },
    }


def plot(result: dict, path: str) -> bool:
    """A PNG of normalised cost against budget, one panel per mode; False (with a note) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}", file=sys.stderr)
        return False
    figure, axes = plt.subplots(1, len(MODES), figsize=(11, 4.2), sharey=True)
    for axis, mode in zip(axes, MODES):
        for method in result["methods"]:
            mean = [np.nan if value is None else value for value in result[mode][method]["mean"]]
            axis.plot(result["budgets"], mean, marker="o", label=method)
        axis.set_yscale("log")
        axis.set_xlabel("kept fraction of the rankable tokens")
        axis.set_title(f"{mode.replace('_', '-')} ranking ({result['n_prefixes']} {result['split']} prefixes)")
        axis.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("evicted importance / oracle's (mean over heads)")
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def print_table(result: dict) -> None:
    header = "method".ljust(10) + "".join(f"{b:>9.1f}" for b in result["budgets"]) + "     mean"
    for mode in MODES:
        print(f"{mode} ranking, normalised eviction cost ({result['n_prefixes']} {result['split']} prefixes)")
        print(header)
        for method in result["methods"]:
            entry = result[mode][method]
            cells = "".join(f"{value:>9.4g}" if value is not None else "      n/a" for value in entry["mean"])
            mean = entry["mean_over_budgets"]
            print(method.ljust(10) + cells + (f"{mean:>9.4g}" if mean is not None else "      n/a"))
    if all("reward" in result["per_head"][method] for method in result["methods"]):
        print("per_head reward, mean -C(σ)/C(σ*) of the ranking by score over all budgets (what RL maximises): " +
              ", ".join(f"{method} {result['per_head'][method]['reward']:.4f}" for method in result["methods"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", required=True, help="trace directory (docs/traces.md)")
    parser.add_argument("--policy", help="kvp.bin policy to evaluate (omit for the baselines only)")
    parser.add_argument("--split", default="heldout", choices=("train", "heldout"))
    parser.add_argument("--max-prefixes", type=int, help="evaluate only the first N prefixes of the split")
    parser.add_argument("--min-cut", type=int, default=0,
                        help="only prefixes of at least this many tokens (length generalisation: longer than training)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random baseline")
    parser.add_argument("--sources", type=comma_names,
                        help="comma-separated trace sources to evaluate on (ruler, chats, text; default: all)")
    parser.add_argument("--json", help="write the full result here")
    parser.add_argument("--plot", help="write a PNG plot here")
    args = parser.parse_args(argv)
    traces = TraceSet(args.traces)
    policy = pf.read_policy(args.policy) if args.policy else None
    result = evaluate(traces, policy, split=args.split, max_prefixes=args.max_prefixes, min_cut=args.min_cut,
                      seed=args.seed, sources=args.sources)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)
    print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
