"""How much each way of combining per-head scores loses when llama.cpp's shared cells force one token set.

    python -m training.combine_eval --traces DIR [--policy x.kvp.bin] [--json out.json]

For every held-out (sequence, cut) of a trace set and every budget fraction, it measures the share of the future
attention that eviction takes away, per (layer, KV head) and averaged over heads (docs/traces.md defines the
importance). Rows:
- per-head oracle: each head keeps its own top tokens by true importance (the floor);
- shared, <combine> of oracle scores: per-head scores log(importance), combined into one keep-score per token by
  the engine's own code (``_core.combined_keep_scores``), one token set for every head of every layer;
- with --policy: the same for a kvp.bin policy's scores, per head and shared.
The first 4 and last 16 tokens of each prefix are always kept, as at inference.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

import kvp_cpp
from kvp_cpp import _core

COMBINES = ("sum_softmax", "max_softmax", "mean", "mean_rank")
FRACTIONS = (0.1, 0.25, 0.5, 0.75, 0.9)
N_SINK, N_RECENT = 4, 16


def load_heldout(traces: str):
    with open(os.path.join(traces, "manifest.json")) as f:
        manifest = json.load(f)
    model = manifest["model"]
    n_layer, n_kv, dk, dv = (model[k] for k in ("n_layer", "n_head_kv", "head_dim_k", "head_dim_v"))
    for seq in manifest["sequences"]:
        if seq["split"] != "heldout":
            continue
        folder, n = os.path.join(traces, seq["dir"]), seq["n_tokens"]
        k = np.memmap(os.path.join(folder, "k.f16"), np.float16, "r", shape=(n_layer, n, n_kv, dk))
        v = np.memmap(os.path.join(folder, "v.f16"), np.float16, "r", shape=(n_layer, n, n_kv, dv))
        flat = np.fromfile(os.path.join(folder, "importance.f32"), np.float32)
        offset = 0
        for cut in seq["cuts"]:
            size = n_layer * n_kv * cut
            yield seq, cut, k, v, flat[offset:offset + size].reshape(n_layer, n_kv, cut)
            offset += size


def evicted_share(importance: np.ndarray, keep_mask: np.ndarray) -> np.ndarray:
    """Per (layer, head) share of the rankable importance that the evicted tokens carry."""
    rankable = importance[..., N_SINK:-N_RECENT]
    total = rankable.sum(axis=-1)
    lost = (rankable * ~keep_mask[..., N_SINK:-N_RECENT]).sum(axis=-1)
    return np.where(total > 0, lost / np.maximum(total, 1e-30), 0.0)


def keep_top(scores: np.ndarray, n_keep: int) -> np.ndarray:
    """Boolean mask keeping protected tokens plus the n_keep best-scored rankable ones (scores: (..., cut))."""
    mask = np.zeros(scores.shape, bool)
    mask[..., :N_SINK] = True
    mask[..., -N_RECENT:] = True
    middle = scores[..., N_SINK:-N_RECENT]
    order = np.argsort(-middle, axis=-1, kind="stable")[..., :n_keep]
    np.put_along_axis(mask[..., N_SINK:-N_RECENT], order, True, axis=-1)
    return mask


def policy_scores(scorer, k, v, cut):
    n_layer = k.shape[0]
    positions = np.arange(cut, dtype=np.int64)
    return np.stack([scorer.score_layer(layer, np.ascontiguousarray(k[layer, :cut], np.float32),
                                        np.ascontiguousarray(v[layer, :cut], np.float32), positions).T
                     for layer in range(n_layer)])  # (L, H, cut)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", required=True)
    parser.add_argument("--policy", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    scorer = kvp_cpp.Scorer(kvp_cpp.load_policy(args.policy)) if args.policy else None

    rows = {}

    def record(name, fraction, share):
        rows.setdefault(name, {}).setdefault(fraction, []).append(share)

    for seq, cut, k, v, imp in load_heldout(args.traces):
        n_rankable = cut - N_SINK - N_RECENT
        if n_rankable < 10:
            continue
        sources = {"oracle": np.log(imp.astype(np.float64) + 1e-9)}
        if scorer is not None:
            sources["kvp"] = policy_scores(scorer, k, v, cut)
        for fraction in FRACTIONS:
            n_keep = int(round(fraction * n_rankable))
            for source, scores in sources.items():
                record(f"per-head {source}", fraction, evicted_share(imp, keep_top(scores, n_keep)).mean())
                columns = scores.reshape(-1, cut).T.astype(np.float32)  # (tokens, L*H)
                for combine in COMBINES:
                    keep = np.asarray(_core.combined_keep_scores(np.ascontiguousarray(columns), combine))
                    shared = keep_top(keep, n_keep)[None, None, :]
                    record(f"shared {combine} of {source}", fraction,
                           evicted_share(imp, np.broadcast_to(shared, imp.shape)).mean())

    summary = {name: {str(f): float(np.mean(v)) for f, v in by_fraction.items()} for name, by_fraction in rows.items()}
    print("| row | " + " | ".join(f"keep {int(f * 100)}%" for f in FRACTIONS) + " |")
    print("|---|" + "---|" * len(FRACTIONS))
    for name, by_fraction in summary.items():
        print(f"| {name} | " + " | ".join(f"{by_fraction[str(f)]:.3f}" for f in FRACTIONS) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"fractions": FRACTIONS, "evicted_share": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
