"""Per-agent temperature calibration: rescale each agent's scores, keeping every head's order, so that the softmax
of its scores fits the importance distribution.

    python -m training.calibrate --traces traces-chats --sources chats,text --policy rl.kvp.bin --out rl-t.kvp.bin

An RL-trained agent's reward depends only on the order of its scores, so their scale is arbitrary, agent by agent.
The evictor's shared vote (`sum_softmax`) and per-head head consensus add the heads' softmaxes, which needs a scale
that means the same in every head. Multiplying an agent's last layer (weights and bias) and its recency term by a
temperature t > 0 multiplies its score by t and keeps its ranking. Each agent's t is picked from a log-spaced grid
to minimise the listwise loss, the cross-entropy of softmax(t * score) against I / sum(I), summed over the training
prefixes' rankable tokens (the tokens the evictor ranks: not the first n_sink nor the last n_recent).
"""
from __future__ import annotations

import argparse
import copy
import sys
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from kvp_cpp import policy_file as pf

from .evaluate import policy_score_fn, rankable_prefixes, scored_layers
from .traces import TraceSet, comma_names

DEFAULT_GRID = np.geomspace(1e-2, 1e2, 161)


def cross_entropy_by_temperature(scores: np.ndarray, importance: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """(len(grid),) cross-entropy of softmax(t * scores) against importance / sum(importance), for each t."""
    p = importance / importance.sum()
    scaled = grid[:, None] * scores[None, :]
    top = scaled.max(axis=1)
    log_z = top + np.log(np.exp(scaled - top[:, None]).sum(axis=1))
    return log_z - grid * float(p @ scores)


def fit_temperatures(traces: TraceSet, policy: pf.PolicyData, *, split: str = "train",
                     sources: Optional[Sequence[str]] = None, max_prefixes: Optional[int] = None,
                     grid: np.ndarray = DEFAULT_GRID) -> Dict[Tuple[int, int], float]:
    """{(layer, head): t} minimising each agent's summed listwise loss over a split's prefixes."""
    layers = scored_layers(policy, traces)
    score = policy_score_fn(policy)
    prefixes = rankable_prefixes(traces, split, sources, policy.n_sink + policy.n_recent, max_prefixes=max_prefixes)
    if not prefixes:
        raise ValueError(f"no prefixes of split {split!r} to calibrate on")
    loss = {agent: np.zeros(len(grid)) for agent in policy.agents}
    for index, cut in prefixes:
        rankable = slice(policy.n_sink, cut - policy.n_recent)
        for trace in traces.read_prefix(index, cut, layers):
            scores = np.asarray(score(trace), dtype=np.float64)[:, rankable]
            importance = np.asarray(trace.importance, dtype=np.float64)[:, rankable]
            for head in range(traces.n_head_kv):
                if importance[head].sum() > 0:
                    loss[trace.layer, head] += cross_entropy_by_temperature(scores[head], importance[head], grid)
    return {agent: float(grid[int(np.argmin(values))]) for agent, values in loss.items()}


def calibrated(policy: pf.PolicyData, temperatures: Dict[Tuple[int, int], float]) -> pf.PolicyData:
    """A copy of the policy whose agent (l, h) scores exactly t times what it scored (t = temperatures[l, h])."""
    if set(temperatures) != set(policy.agents):
        raise ValueError("a temperature is needed for every agent of the policy, and only for those")
    if any(not t > 0 for t in temperatures.values()):
        raise ValueError("temperatures must be positive: a scale <= 0 would reverse or erase the ranking")
    out = copy.deepcopy(policy)
    for agent, t in temperatures.items():
        mlp = out.agents[agent]
        dtype = mlp.weights[-1].dtype
        mlp.weights[-1] = (mlp.weights[-1].astype(np.float64) * t).astype(dtype)
        mlp.biases[-1] = (mlp.biases[-1].astype(np.float64) * t).astype(mlp.biases[-1].dtype)
        if out.recency:
            out.recency[agent] = (np.asarray(out.recency[agent], dtype=np.float64) * t).astype(np.float32)
    values = np.array(list(temperatures.values()))
    # the training run's held-out summary was measured before calibration; its shared ranking no longer holds
    out.metadata = {key: value for key, value in out.metadata.items() if key != "heldout"}
    out.metadata = dict(out.metadata, calibration={
        "objective": "listwise cross-entropy, one temperature per agent, MLP and recency term fixed",
        "temperature_median": float(np.median(values)), "temperature_min": float(values.min()),
        "temperature_max": float(values.max())})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", required=True, help="trace directory (docs/traces.md)")
    parser.add_argument("--policy", required=True, help="kvp.bin policy to calibrate")
    parser.add_argument("--out", required=True, help="calibrated kvp.bin to write")
    parser.add_argument("--sources", type=comma_names, help="trace sources to calibrate on (default: all)")
    parser.add_argument("--max-prefixes", type=int, help="calibrate on at most this many training prefixes")
    args = parser.parse_args(argv)
    traces = TraceSet(args.traces)
    policy = pf.read_policy(args.policy)
    temperatures = fit_temperatures(traces, policy, sources=args.sources, max_prefixes=args.max_prefixes)
    at_edge = sum(t in (DEFAULT_GRID[0], DEFAULT_GRID[-1]) for t in temperatures.values())
    if at_edge:
        print(f"calibrate: {at_edge} agents' temperatures sit at the edge of the grid "
              f"[{DEFAULT_GRID[0]:g}, {DEFAULT_GRID[-1]:g}]", file=sys.stderr)
    result = calibrated(policy, temperatures)
    pf.write_policy(args.out, result)
    c = result.metadata["calibration"]
    print(f"calibrate: {len(temperatures)} agents, temperature median {c['temperature_median']:.3g} "
          f"(range {c['temperature_min']:.3g} to {c['temperature_max']:.3g}); wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
