"""``python -m kvp_cpp.compare LOG.samples.jsonl [...] --reference kvp:NAME``: paired comparisons of kvp-bench runs.

kvp-bench's table gives each policy's mean score and its standard error. Policies that run on the same samples
are better compared sample by sample: the difference of two policies on each sample, averaged, has a much
smaller standard error than either mean, because the samples' difficulty cancels. This reads kvp-bench's
per-sample logs (``-o X.json`` writes ``X.samples.jsonl``) and prints, per (protocol, variant, length), in
Markdown:

* the mean score over tasks of every series at every budget, on the samples that every series completed
  (RULER's aggregation: the unweighted mean of the task means), and the full cache's;
* the reference series minus each other series, paired over those samples: mean ± standard error, and on how
  many samples the reference did better / worse;
* the same two tables restricted to the tasks where the full cache scores at least ``--min-full`` (a model that
  fails a task with its whole cache says nothing about eviction on it);
* each task's means;
* with ``--agreement``, the same tables for how close each series' generated text is to the full cache's on the
  same sample (difflib's similarity ratio, 0-100), which separates what eviction changed from what the model gets
  wrong anyway on tasks the full cache fails.

Perplexity runs (``kvp-bench --text``: records whose metric is ``mean_nll``, nats per token) get the same tables,
paired over the texts, where lower is better: a sample counts as better for the reference when its NLL is lower,
and each series' perplexity is also given relative to the full cache's, exp(NLL − NLL_full) − 1.

A series is a policy in a KV mode with, per head, its head consensus when not 0 (``keydiff``, ``keydiff (per
head)``, ``kvp:x (per head w=0.9)``; per-head records written before kvp-bench recorded the consensus count as 0), and
with ``--evict-unit word`` a ``(words)`` suffix (``kvp:x (words)``).
Several logs may be given; ``LOG@TAG`` appends `` [TAG]`` to the series of that log, so that runs of the same
policy with other settings (say ``--sink``) are told apart. ``--json`` writes the same numbers.
"""
from __future__ import annotations

import argparse
import collections
import difflib
import functools
import json
import math
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from .plot import PER_HEAD_SUFFIX, PERPLEXITY_METRIC as NLL, WORDS_SUFFIX, short_label

FULL = "full"
Panel = Tuple[str, str, int]  # protocol, variant, length
Sample = Tuple[str, int]      # task, index


def series_name(record: dict, tag: str = "") -> str:
    name = short_label(record["policy"])
    if record.get("kv_mode") == "per_head":
        consensus = record.get("head_consensus", 0)
        name += PER_HEAD_SUFFIX if consensus == 0 else f"{PER_HEAD_SUFFIX[:-1]} w={consensus:g})"
    if record.get("evict_unit") == "word":
        name += WORDS_SUFFIX
    return f"{name} [{tag}]" if tag else name


def read_logs(paths: Sequence[str]) -> List[dict]:
    """Records of kvp-bench per-sample logs; ``PATH@TAG`` tags that log's series. A cut-off last line is skipped;
    a record seen twice (a resumed run) counts once."""
    records, seen = [], set()
    for spec in paths:
        path, _, tag = spec.partition("@")
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if not isinstance(record, dict) or "score" not in record:
                    continue
                record["series"] = FULL if record["policy"] == FULL else series_name(record, tag)
                key = (record.get("protocol"), record.get("variant"), record.get("length"), record["task"],
                       record["index"], record["series"], record.get("budget"))
                if key not in seen:
                    seen.add(key)
                    records.append(record)
    return records


def mean_and_stderr(values: Sequence[float]) -> Tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    variance = sum((x - mean) ** 2 for x in values) / (n - 1)
    return mean, math.sqrt(variance / n)


def compare_panel(records: Sequence[dict], reference: Optional[str], budgets: Optional[Sequence[int]] = None,
                  max_samples: int = 0, min_full: Optional[float] = None, agreement: bool = False) -> dict:
    """One (protocol, variant, length): scores on the samples complete for every series, budget and the full cache."""
    score: Dict[tuple, float] = {}
    series_budgets: Dict[str, set] = collections.defaultdict(set)
    for r in records:
        score[(r["series"], r.get("budget"), r["task"], r["index"])] = float(r["score"])
        if r["series"] != FULL:
            series_budgets[r["series"]].add(r["budget"])
    all_budgets = sorted(set(budgets) if budgets else set().union(*series_budgets.values()))
    metrics = {r.get("metric") for r in records}
    lower_is_better = NLL in metrics
    if lower_is_better and len(metrics) > 1:
        raise SystemExit(f"{panel_of(records[0])} mixes perplexity (mean_nll) with task scores "
                         f"{sorted(metrics - {NLL})}")
    series = sorted(series_budgets, key=lambda s: (s != reference, s))
    samples = sorted({(r["task"], r["index"]) for r in records}, key=lambda s: (s[1], s[0]))
    complete = [s for s in samples if series and (FULL, None) + s in score
                and all((n, b) + s in score for n in series for b in all_budgets)]
    if max_samples > 0:  # the first N complete samples of each task, by index
        kept, taken = [], collections.Counter()
        for task, index in complete:
            taken[task] += 1
            if taken[task] <= max_samples:
                kept.append((task, index))
        complete = kept
    tasks = sorted({t for t, _ in complete})
    per_task = collections.Counter(t for t, _ in complete)
    full = {t: sum(score[(FULL, None, t, i)] for u, i in complete if u == t) / per_task[t] for t in tasks}
    if min_full is not None and not lower_is_better:  # a mean of thirds that should be 30 may come out as 29.999...
        tasks = [t for t in tasks if full[t] >= min_full - 1e-9]
        complete = [s for s in complete if s[0] in tasks]

    result = {"tasks": tasks, "samples_per_task": {t: per_task[t] for t in tasks}, "budgets": all_budgets,
              "full": {"mean": sum(full[t] for t in tasks) / len(tasks) if tasks else float("nan"),
                       "per_task": {t: full[t] for t in tasks}},
              "metric": NLL if lower_is_better else "score", "lower_is_better": lower_is_better}
    paired_with = reference if reference in series_budgets else None
    result.update(_means_and_paired(score, series, all_budgets, tasks, complete, paired_with, lower_is_better))
    if lower_is_better and tasks:
        result["perplexity_vs_full"] = {
            name: {str(b): math.exp(result["series"][name][str(b)]["mean"] - result["full"]["mean"]) - 1.0
                   for b in all_budgets} for name in series}
    if agreement and not lower_is_better:  # perplexity runs generate no text
        answer = {(r["series"], r.get("budget"), r["task"], r["index"]): r for r in records}
        similarity = {(n, b) + s: agreement_with_full(answer[(FULL, None) + s], answer[(n, b) + s])
                      for n in series for b in all_budgets for s in complete}
        result["agreement"] = _means_and_paired(similarity, series, all_budgets, tasks, complete, paired_with)
    return result


def agreement_with_full(full: dict, other: dict) -> float:
    """How close a series' answer is to the full cache's on the same sample, 0-100: difflib's similarity ratio of
    the two generated texts (100: the same text). It tells eviction apart from the model's own failures on tasks
    the full cache does not solve, where a score can rise because eviction changed a wrong answer."""
    for record in (full, other):
        if not isinstance(record.get("prediction"), str):
            raise SystemExit(f"{record['task']} #{record['index']} ({record['series']}) has no generated text "
                             "('prediction') in its log, which the agreement table needs")
    return _text_similarity(full["prediction"], other["prediction"])


@functools.lru_cache(maxsize=None)  # main() compares every panel twice (all tasks, then the solvable ones)
def _text_similarity(a: str, b: str) -> float:
    return 100.0 * difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


def _means_and_paired(value: Dict[tuple, float], series: Sequence[str], budgets: Sequence[int],
                      tasks: Sequence[str], complete: Sequence[Sample], reference: Optional[str],
                      lower_is_better: bool = False) -> dict:
    """Each series' mean over tasks of its task means at every budget, and the reference minus each other series,
    paired over the complete samples. ``value`` maps (series, budget, task, index) to a number. "better" counts
    the samples where the reference's value is higher, or lower with ``lower_is_better`` (perplexity)."""
    def task_mean(name: str, budget, task: str) -> float:
        values = [value[(name, budget, t, i)] for t, i in complete if t == task]
        return sum(values) / len(values)

    result = {"series": {}, "paired": {}}
    for name in series:
        result["series"][name] = {
            str(b): {"mean": sum(task_mean(name, b, t) for t in tasks) / len(tasks) if tasks else float("nan"),
                     "per_task": {t: task_mean(name, b, t) for t in tasks}} for b in budgets}
    if reference is not None and complete:
        for name in series:
            if name == reference:
                continue
            result["paired"][name] = {}
            for b in budgets:
                differences = [value[(reference, b) + s] - value[(name, b) + s] for s in complete]
                mean, stderr = mean_and_stderr(differences)
                higher, lower = sum(d > 0 for d in differences), sum(d < 0 for d in differences)
                result["paired"][name][str(b)] = {
                    "mean": mean, "stderr": stderr, "n": len(differences),
                    "better": lower if lower_is_better else higher, "worse": higher if lower_is_better else lower}
    return result


def panel_of(record: dict) -> Panel:
    return record.get("protocol", ""), record.get("variant", ""), record.get("length", 0)


def compare(records: Sequence[dict], reference: Optional[str], **options) -> Dict[Panel, dict]:
    panels: Dict[Panel, List[dict]] = collections.OrderedDict()
    for r in records:
        panels.setdefault(panel_of(r), []).append(r)
    return {panel: compare_panel(members, reference, **options) for panel, members in panels.items()}


def why_no_sample_is_complete(records: Sequence[dict], panel: Panel) -> str:
    """Every table pairs against the full cache, so a panel whose logs lack it says which log to add."""
    if not any(r["series"] == FULL and panel_of(r) == panel for r in records):
        return ("the logs hold no full-cache result for it (policy 'full'), which every table pairs against: "
                "add the log of a run with --policies full")
    if all(r["series"] == FULL for r in records if panel_of(r) == panel):
        return "the logs hold only the full cache's results for it"
    return "no sample is complete for every series and budget"


def _number(x: float, digits: int = 1) -> str:
    return "–" if x != x else f"{x:.{digits}f}"


def markdown(panel: Panel, result: dict, reference: Optional[str], title: str = "") -> str:
    budgets = result["budgets"]
    n = sum(result["samples_per_task"].values())
    lines = [f"### {panel[0]}, {panel[1]}, {panel[2]} tokens{title}: {len(result['tasks'])} tasks, {n} samples "
             f"complete for every series", ""]
    if result.get("lower_is_better"):
        lines += ["Mean negative log-likelihood, nats per token (lower is better):", ""]
    digits = 3 if result.get("lower_is_better") else 1
    lines += _tables(result, budgets, reference, full_row=result["full"], digits=digits)
    if "perplexity_vs_full" in result:
        lines += ["", "Perplexity relative to the full cache's, exp(NLL − NLL_full) − 1:", "",
                  "| series | " + " | ".join(str(b) for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
        for name, by_budget in result["perplexity_vs_full"].items():
            lines.append(f"| {name} | " + " | ".join(f"{100 * by_budget[str(b)]:+.1f}%" for b in budgets) + " |")
    if "agreement" in result:
        lines += ["", "Agreement with the full cache's answer on the same samples (difflib similarity of the generated "
                  "texts, 0-100; 100: the same text):", ""]
        lines += _tables(result["agreement"], budgets, reference, tasks=result["tasks"])
    return "\n".join(lines)


def _tables(result: dict, budgets: Sequence[int], reference: Optional[str], full_row: Optional[dict] = None,
            tasks: Optional[Sequence[str]] = None, digits: int = 1) -> List[str]:
    """Means per series and budget, the paired differences, and each task's means."""
    tasks = result["tasks"] if tasks is None else tasks
    lines = ["| series | " + " | ".join(str(b) for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for name, by_budget in result["series"].items():
        label = f"**{name}**" if name == reference else name
        lines.append(f"| {label} | " + " | ".join(_number(by_budget[str(b)]["mean"], digits) for b in budgets) + " |")
    if full_row is not None:
        lines.append(f"| full cache | {_number(full_row['mean'], digits)} |" + " |" * (len(budgets) - 1))
    if result["paired"]:
        lines += ["", f"{reference} minus each series, paired (mean ± standard error; samples better / worse):", "",
                  "| vs | " + " | ".join(str(b) for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
        for name, by_budget in result["paired"].items():
            cells = [f"{d['mean']:+.{digits}f} ± {d['stderr']:.{digits}f} ({d['better']}/{d['worse']})"
                     for d in (by_budget[str(b)] for b in budgets)]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| series | budget | " + " | ".join(tasks) + " |", "|---|---|" + "---|" * len(tasks)]
    if full_row is not None:
        lines.append("| full cache | | " + " | ".join(_number(full_row["per_task"][t], digits) for t in tasks) + " |")
    for name, by_budget in result["series"].items():
        for b in budgets:
            lines.append(f"| {name} | {b} | " +
                         " | ".join(_number(by_budget[str(b)]["per_task"][t], digits) for t in tasks) + " |")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvp_cpp.compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", help="kvp-bench per-sample logs (X.samples.jsonl), each optionally @TAG")
    parser.add_argument("--reference", default=None,
                        help="the series the others are compared with (default: the first learned policy, kvp:...)")
    parser.add_argument("--budgets", default=None, help="comma-separated budgets (default: every budget logged)")
    parser.add_argument("--samples", type=int, default=0, help="at most N samples per task (default: all complete)")
    parser.add_argument("--first-sample", type=int, default=0,
                        help="leave out samples whose index is below N: the fresh samples of a longer run, to "
                             "confirm a choice made on the first N")
    parser.add_argument("--min-full", type=float, default=30.0,
                        help="the restricted tables keep tasks where the full cache scores at least this (default 30)")
    parser.add_argument("--series", default=None, help="comma-separated series to keep (default: all)")
    parser.add_argument("--agreement", action="store_true",
                        help="also compare each series' generated text with the full cache's on the same sample "
                             "(difflib similarity, 0-100), paired like the scores")
    parser.add_argument("--json", default=None, help="also write the numbers to this file")
    args = parser.parse_args(argv)

    records = [r for r in read_logs(args.logs) if r["index"] >= args.first_sample]
    if args.series:
        keep = set(args.series.split(",")) | {FULL}
        unknown = keep - {r["series"] for r in records}
        if unknown:
            raise SystemExit(f"no series {sorted(unknown)} in the logs; they hold {sorted({r['series'] for r in records})}")
        records = [r for r in records if r["series"] in keep]
    if not records:
        raise SystemExit("the logs hold no results")
    names = sorted({r["series"] for r in records} - {FULL})
    reference = args.reference or next((s for s in names if s.startswith("kvp:")), None)
    if reference is not None and reference not in names:
        raise SystemExit(f"no series {reference!r} in the logs; they hold {names}")
    budgets = [int(b) for b in args.budgets.split(",")] if args.budgets else None
    options = dict(budgets=budgets, max_samples=args.samples, agreement=args.agreement)
    everything = compare(records, reference, **options)
    restricted = compare(records, reference, min_full=args.min_full, **options)
    out = {}
    for panel, result in everything.items():
        if not result["tasks"]:
            print(f"{panel}: {why_no_sample_is_complete(records, panel)}", file=sys.stderr)
            continue
        print(markdown(panel, result, reference))
        print()
        solvable = restricted[panel]
        if solvable["tasks"] and solvable["tasks"] != result["tasks"]:
            print(markdown(panel, solvable, reference, f", tasks where the full cache scores ≥ {args.min_full:g}"))
            print()
        key = "/".join(map(str, panel))
        out[key] = {"all_tasks": result}
        if not result["lower_is_better"]:  # a full-cache score threshold means nothing for perplexity
            out[key]["full_at_least"] = {"min_full": args.min_full, **solvable}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"logs": args.logs, "reference": reference, "panels": out}, f, indent=2)
    return 0 if out else 1  # nothing to compare is an error, not an empty report


if __name__ == "__main__":
    raise SystemExit(main())
