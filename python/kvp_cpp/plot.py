"""``python -m kvp_cpp.plot results.json [more.json ...] [-o DIR] [--stem NAME]``: PNG plots of ``kvp-bench`` runs
(see docs/bench.md); several runs (a 2K and a 4K sweep) are drawn as panels of one figure.

* ``<stem>-score.png``: the mean task score over tasks against the absolute cache size (tokens kept), one line per
  policy, one panel per (variant, context length); attention-based policies (those observing queries) dashed, the ``full``
  reference a grey horizontal line.
* ``<stem>-tasks.png``: the same per task, one panel per (variant, task, length), with standard errors.
* ``<stem>-perplexity.png``: perplexity (exp of the mean NLL) of the continuation against the cache size.

Needs matplotlib (``pip install matplotlib``).
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
from typing import Dict, List, Optional, Sequence

SCHEMA_PREFIX = "kvp-bench/"
PERPLEXITY_METRIC = "mean_nll"


def load_results(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        document = json.load(f)
    if not str(document.get("schema", "")).startswith(SCHEMA_PREFIX):
        raise ValueError(f"{path} is not a kvp-bench results file (schema {document.get('schema')!r})")
    return document


PER_HEAD_SUFFIX = " (per head)"
WORDS_SUFFIX = " (words)"


def short_label(label: str) -> str:
    """``kvp:models/ruler.kvp.bin`` -> ``kvp:ruler``; other labels unchanged (a per-head series keeps its suffix)."""
    for suffix in (WORDS_SUFFIX, PER_HEAD_SUFFIX):
        if label.endswith(suffix):
            return short_label(label[: -len(suffix)]) + suffix
    if label.startswith("kvp:") or label.endswith(".kvp.bin"):
        name = os.path.basename(label[4:] if label.startswith("kvp:") else label)
        return "kvp:" + (name[: -len(".kvp.bin")] if name.endswith(".kvp.bin") else name)
    return label


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit("kvp_cpp.plot needs matplotlib: pip install matplotlib") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _attention_based(document: dict) -> Dict[str, bool]:
    return {p["label"]: bool(p.get("attention_based")) for p in document.get("config", {}).get("policies", [])}


def _grid(plt, n_panels: int, width: float = 4.2, height: float = 3.2):
    columns = min(n_panels, 3)
    rows = math.ceil(n_panels / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(width * columns, height * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n_panels:]:
        ax.set_visible(False)
    return figure, flat[:n_panels]


def _draw_panel(ax, series: Dict[str, List[tuple]], attention: Dict[str, bool], colors: Dict[str, str],
                transform=lambda y: y, with_errors: bool = False) -> None:
    """series: policy -> [(budget or None, score, stderr)]; budget None is the full cache."""
    budgets = sorted({p[0] for points in series.values() for p in points if p[0] is not None})
    for policy, points in series.items():
        full = [p for p in points if p[0] is None]
        if full:
            ax.axhline(transform(full[0][1]), color="0.4", linestyle=":", linewidth=1.2, label=short_label(policy))
            continue
        points = sorted(points)
        xs = [p[0] for p in points]
        ys = [transform(p[1]) for p in points]
        style = "--" if attention.get(policy) else "-"
        width = 2.2 if short_label(policy).startswith("kvp:") else 1.3  # the learned policy stands out
        if with_errors:
            errors = [abs(transform(p[1] + p[2]) - transform(p[1])) for p in points]
            ax.errorbar(xs, ys, yerr=errors, linestyle=style, linewidth=width, marker="o", markersize=3, capsize=2,
                        color=colors.get(policy), label=short_label(policy))
        else:
            ax.plot(xs, ys, linestyle=style, linewidth=width, marker="o", markersize=3, color=colors.get(policy),
                    label=short_label(policy))
    ax.set_xscale("log", base=2)
    if budgets:
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.minorticks_off()
    ax.set_xlabel("cache size (tokens)")
    ax.grid(True, alpha=0.3)


def _legend_outside(figure, axes) -> None:
    """One legend for the figure, right of the panels, so that it never hides a line; a series drawn in only some
    panels (a per-head run of one length, say) is listed too."""
    entries: Dict[str, object] = collections.OrderedDict()
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    figure.legend(list(entries.values()), list(entries.keys()), loc="center left", bbox_to_anchor=(1.0, 0.5),
                  fontsize=8, frameon=False)


def _colors(plt, rows: Sequence[dict]) -> Dict[str, str]:
    """One colour per series for every panel of a figure, whichever panels the series is in."""
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    labels = collections.OrderedDict.fromkeys(r["policy"] for r in rows if r["budget"] is not None)
    return {label: cycle[i % len(cycle)] for i, label in enumerate(labels)}


def _series(rows: Sequence[dict]) -> Dict[str, List[tuple]]:
    series: Dict[str, List[tuple]] = collections.OrderedDict()
    for row in rows:
        series.setdefault(row["policy"], []).append((row["budget"], row["score"], row["stderr"]))
    return series


def _mean_over_tasks(rows: Sequence[dict]) -> List[dict]:
    """One row per (policy, budget): the unweighted mean of the task scores (RULER's aggregation)."""
    groups: Dict[tuple, List[dict]] = collections.OrderedDict()
    for row in rows:
        groups.setdefault((row["policy"], row["budget"]), []).append(row)
    means = []
    for (policy, budget), members in groups.items():
        k = len(members)
        means.append({"policy": policy, "budget": budget, "score": sum(r["score"] for r in members) / k,
                      "stderr": math.sqrt(sum(r["stderr"] ** 2 for r in members)) / k})
    return means


def plot(document: dict, out_dir: str, stem: str) -> List[str]:
    """Writes the plots that the results allow; returns their paths."""
    plt = _pyplot()
    attention = _attention_based(document)
    # per-head runs (kvp-bench --kv-modes) and word-level eviction (--evict-unit word) are series of their own,
    # styled as their policy
    rows = [dict(r, policy=r["policy"] + PER_HEAD_SUFFIX) if r.get("kv_mode") == "per_head" else r
            for r in document["results"]]
    rows = [dict(r, policy=r["policy"] + WORDS_SUFFIX) if r.get("evict_unit") == "word" else r for r in rows]
    attention.update({label + PER_HEAD_SUFFIX: based for label, based in list(attention.items())})
    attention.update({label + WORDS_SUFFIX: based for label, based in list(attention.items())})
    colors = _colors(plt, rows)
    task_rows = [r for r in rows if r["metric"] != PERPLEXITY_METRIC]
    ppl_rows = [r for r in rows if r["metric"] == PERPLEXITY_METRIC]
    os.makedirs(out_dir, exist_ok=True)
    written = []

    def save(figure, suffix: str) -> None:
        path = os.path.join(out_dir, f"{stem}-{suffix}.png")
        figure.tight_layout()
        figure.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(figure)
        written.append(path)

    model = document.get("model", {}).get("name", "")
    protocol = document.get("config", {}).get("protocol", "")
    if task_rows:
        variant_names = {"question_included": "question included", "question_excluded": "question excluded"}

        def variant_of(row: dict) -> str:
            return variant_names.get(row.get("variant", ""), row.get("variant", ""))

        panels = list(collections.OrderedDict.fromkeys((variant_of(r), r["length"]) for r in task_rows))
        figure, axes = _grid(plt, len(panels))
        for ax, (variant, length) in zip(axes, panels):
            members = [r for r in task_rows if (variant_of(r), r["length"]) == (variant, length)]
            _draw_panel(ax, _series(_mean_over_tasks(members)), attention, colors)
            ax.set_title(f"mean over tasks, {length} tokens\n{protocol}, {variant}", fontsize=9)
            ax.set_ylabel("score")
        _legend_outside(figure, axes)
        figure.suptitle(model, fontsize=9)
        save(figure, "score")

        panels = list(collections.OrderedDict.fromkeys((variant_of(r), r["task"], r["length"]) for r in task_rows))
        figure, axes = _grid(plt, len(panels))
        for ax, (variant, task, length) in zip(axes, panels):
            members = [r for r in task_rows if (variant_of(r), r["task"], r["length"]) == (variant, task, length)]
            _draw_panel(ax, _series(members), attention, colors, with_errors=True)
            ax.set_title(f"{task} @ {length}, {variant}", fontsize=9)
            ax.set_ylabel("score")
        _legend_outside(figure, axes)
        figure.suptitle(model, fontsize=9)
        save(figure, "tasks")

    if ppl_rows:
        panels = list(collections.OrderedDict.fromkeys((r["task"], r["length"]) for r in ppl_rows))
        figure, axes = _grid(plt, len(panels))
        for ax, (task, length) in zip(axes, panels):
            _draw_panel(ax, _series([r for r in ppl_rows if (r["task"], r["length"]) == (task, length)]), attention,
                        colors, transform=math.exp, with_errors=True)
            ax.set_title(f"{task}, context {length} tokens")
            ax.set_ylabel("perplexity")
        _legend_outside(figure, axes)
        figure.suptitle(model, fontsize=9)
        save(figure, "perplexity")
    return written


def merge_results(documents: Sequence[dict]) -> dict:
    """Several runs as one document (say a 2K and a 4K sweep, which become panels side by side): their results
    concatenated, their policies united; the model and protocol are the first run's, and must be the same in all."""
    first = documents[0]
    for other in documents[1:]:
        for what, get in (("model", lambda d: d.get("model", {}).get("name")),
                          ("protocol", lambda d: d.get("config", {}).get("protocol"))):
            if get(other) != get(first):
                raise ValueError(f"cannot plot runs of different {what}s together: {get(first)!r} and {get(other)!r}")
    policies = collections.OrderedDict()
    for document in documents:
        for p in document.get("config", {}).get("policies", []):
            policies.setdefault(p["label"], p)
    return dict(first, config=dict(first.get("config", {}), policies=list(policies.values())),
                results=[r for document in documents for r in document["results"]])


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvp_cpp.plot", description="Plot kvp-bench results files.")
    parser.add_argument("results", nargs="+", help="results JSON written by kvp-bench -o; several are drawn together")
    parser.add_argument("-o", "--out-dir", default=None, help="folder for the PNGs (default: next to the results)")
    parser.add_argument("--stem", default=None, help="PNG name prefix (default: the first results file's name)")
    args = parser.parse_args(argv)
    document = merge_results([load_results(path) for path in args.results])
    out_dir = args.out_dir or os.path.dirname(os.path.abspath(args.results[0]))
    stem = args.stem or os.path.splitext(os.path.basename(args.results[0]))[0]
    for path in plot(document, out_dir, stem):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
