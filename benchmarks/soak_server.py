"""Soak test of the chat server: endless conversations under a KV budget, through HTTP, for --minutes.

Starts ``python -m kvp_cpp.server`` (the shipped policy by default) and drives --conversations chats with the openai
client, interleaved turn by turn, each growing without end: every request sends the whole history, as the OpenAI API
requires. Replies have a fixed length (min_tokens = max_tokens) so that turns are comparable; every third request is
streamed, and every tenth stream is abandoned after a few chunks (the client closes it) and the conversation goes on
from what it received. After every turn it records the server's RSS (VmRSS of its process), the wall time of the turn,
the cells in use and the conversation's logical length.

A *control* conversation runs in the same rotation and starts afresh every --control-restart of its turns, so it
stays short. Its turns, timed at the same moments as the long ones, give the time per turn that the machine allows
right then: the ratio long / control is what the conversations' length costs, free of whatever else the machine
runs (wall times alone drift with other load on a shared machine).

Passes when the RSS after the warm-up grows less than --max-growth, the cells never exceed the budget, every turn
continues its conversation (none is re-prefilled), and the time per turn stays steady: the ratio long / control
(medians over --window turns of each) grows by less than --max-slowdown from just after the warm-up to the end.
The raw drift of the wall time per turn is reported too. Writes a JSON report and a PNG of the curves;
``--from-json`` summarises and plots an earlier run's samples again.

    python benchmarks/soak_server.py [--minutes 20] [--budget 256] [--policy kvp] [--conversations 2]
                                     [--json benchmarks/results/soak_server.json] [--png benchmarks/results/soak_server.png]

Exit status 0 when it passes, 1 when it does not.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from typing import Any, Dict, List

from kvp_cpp.server.spawn import ServerProcess, environment_threads

TOPICS = ["the sea", "a mountain village", "the history of bread", "a robot learning to paint", "winter mornings",
          "how bridges stand", "a lost key", "the moon landing", "a library at night", "bees", "old maps",
          "a rainy market", "trains at dawn", "lighthouses", "a garden in spring"]  # fmt: skip
REQUESTS = ["Tell me something about {}.", "Write two sentences about {}.", "What is surprising about {}?",
            "Continue the story, and bring in {}.", "Explain {} to a child."]  # fmt: skip


def turn_once(client, messages: List[Dict[str, str]], args, mode: str, seed: int) -> Dict[str, Any]:
    """One request; returns the reply text and the turn's kv report."""
    options = dict(model="local", messages=messages, max_tokens=args.reply_tokens, temperature=args.temperature,
                   seed=seed, extra_body={"min_tokens": args.reply_tokens})  # fmt: skip
    if mode == "plain":
        raw = client.chat.completions.with_raw_response.create(**options)
        report = {k[len("x-kv-"):].replace("-", "_"): v for k, v in raw.headers.items() if k.startswith("x-kv-")}
        return {"text": raw.parse().choices[0].message.content or "", "report": report}
    stream = client.chat.completions.create(stream=True, **options)
    pieces, report = [], {}
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        report = (chunk.model_extra or {}).get("kv_stats", report)
        if mode == "abandon" and len(pieces) >= 4:
            stream.close()
            break
    return {"text": "".join(pieces), "report": report}


def run(args) -> Dict[str, Any]:
    from openai import OpenAI

    server_args = ["--kv-policy", args.policy, "--kv-budget", str(args.budget), "--n_ctx", str(args.budget),
                   "--kv-conversations", str(args.kv_conversations)]
    if args.model:
        server_args += ["--model", args.model]
    rng = random.Random(args.seed)
    samples: List[Dict[str, Any]] = []
    with ServerProcess(server_args + environment_threads(), log_path=args.log) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        control = args.conversations  # the last in the rotation: restarted every --control-restart turns
        histories: List[List[Dict[str, str]]] = [[] for _ in range(args.conversations + 1)]
        start = time.perf_counter()
        deadline = start + 60 * args.minutes
        turn = 0
        while time.perf_counter() < deadline:
            c = turn % (args.conversations + 1)
            if c == control and len(histories[c]) >= 2 * args.control_restart:
                histories[c] = []
            request = rng.choice(REQUESTS).format(rng.choice(TOPICS))
            histories[c].append({"role": "user", "content": request})
            mode = "plain" if turn % 3 else ("abandon" if turn % 30 == 0 else "stream")
            began = time.perf_counter()
            result = turn_once(client, histories[c], args, mode, seed=args.seed + turn)
            seconds = time.perf_counter() - began
            histories[c].append({"role": "assistant", "content": result["text"]})
            report = result["report"]
            if mode == "abandon":  # the server records the turn once it notices that the client left
                for _ in range(100):
                    stats = server.get("/kv/stats")
                    if not stats["in_turn"]:
                        break
                    time.sleep(0.05)
                report = stats["last_turn"]
            samples.append({"turn": turn, "conversation": c, "control": c == control,
                            "control_turn": len(histories[c]) // 2 if c == control else None,
                            "mode": mode, "seconds": seconds,
                            "elapsed": time.perf_counter() - start, "rss_bytes": server.rss_bytes(),
                            "cells_used": int(report.get("cells_used", -1)),
                            "logical_tokens": int(report.get("logical_tokens", -1)),
                            "evaluated_tokens": int(report.get("evaluated_tokens", -1)),
                            "match": report.get("match")})  # fmt: skip
            if turn % args.print_every == 0:
                s = samples[-1]
                print(f"{s['elapsed']:7.0f} s  turn {turn:>5}  {mode:>7}  {seconds:5.2f} s  RSS "
                      f"{s['rss_bytes'] / 2**20:7.1f} MiB  cells {s['cells_used']:>4}  logical {s['logical_tokens']:>7}",
                      flush=True)  # fmt: skip
            turn += 1
        stats = server.get("/kv/stats")
    return summarise(args, samples, stats)


def summarise(args, samples: List[Dict[str, Any]], stats: Dict[str, Any]) -> Dict[str, Any]:
    warm = [s for s in samples if s["elapsed"] >= 60 * args.warmup_minutes]
    if len(warm) < 2 * args.window:
        raise SystemExit(f"too few turns after the {args.warmup_minutes}-minute warm-up; run longer")
    baseline = warm[0]["rss_bytes"]
    peak = max(s["rss_bytes"] for s in warm)
    growth = (peak - baseline) / baseline
    timed = [s for s in warm if s["mode"] != "abandon"]
    long_turns = [s for s in timed if not s["control"]]
    control_turns = [s for s in timed if s["control"] and s["control_turn"] > 2]  # past its new prompt
    early = statistics.median(s["seconds"] for s in long_turns[: args.window])
    late = statistics.median(s["seconds"] for s in long_turns[-args.window :])
    slowdown = late / early - 1
    control_early = statistics.median(s["seconds"] for s in control_turns[: args.window])
    control_late = statistics.median(s["seconds"] for s in control_turns[-args.window :])
    length_cost_early, length_cost_late = early / control_early, late / control_late
    max_cells = max(s["cells_used"] for s in samples)
    continued = [s for s in samples[args.conversations + 1 :] if s["mode"] != "abandon"
                 and not (s["control"] and s["control_turn"] == 1)]  # fmt: skip
    all_continued = all(s["match"] in ("continued", "forked") for s in continued)
    length_cost_growth = length_cost_late / length_cost_early - 1
    passed = (growth < args.max_growth and max_cells <= args.budget and all_continued
              and length_cost_growth < args.max_slowdown)  # fmt: skip
    return {
        "config": {"minutes": args.minutes, "budget": args.budget, "policy": args.policy,
                   "conversations": args.conversations, "reply_tokens": args.reply_tokens,
                   "temperature": args.temperature, "seed": args.seed, "warmup_minutes": args.warmup_minutes,
                   "window": args.window, "max_growth": args.max_growth, "max_slowdown": args.max_slowdown,
                   "control_restart": args.control_restart, "kv_conversations": args.kv_conversations,
                   "model": os.path.basename(args.model) if args.model else "SmolLM2-135M-Instruct (default)",
                   "machine": f"{platform.machine()}, {os.cpu_count()} cpus", "command": " ".join(sys.argv)},
        "summary": {"turns": len(samples), "seconds": samples[-1]["elapsed"],
                    "logical_tokens": [max(s["logical_tokens"] for s in samples if s["conversation"] == c)
                                       for c in range(args.conversations)],
                    "control_logical_tokens_max": max(s["logical_tokens"] for s in samples if s["control"]),
                    "rss_at_warmup_bytes": baseline, "rss_peak_after_warmup_bytes": peak, "rss_growth": growth,
                    "turn_seconds_after_warmup": early, "turn_seconds_at_end": late, "slowdown": slowdown,
                    "control_turn_seconds_after_warmup": control_early, "control_turn_seconds_at_end": control_late,
                    "length_cost_after_warmup": length_cost_early, "length_cost_at_end": length_cost_late,
                    "length_cost_growth": length_cost_growth,
                    "max_cells_used": max_cells, "all_turns_continued": all_continued,
                    "store": stats["conversations"], "kv": stats["kv"], "passed": passed},
        "samples": samples,
    }  # fmt: skip


def plot(report: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    config, summary, samples = report["config"], report["summary"], report["samples"]
    minutes = [s["elapsed"] / 60 for s in samples]
    fig, (rss_axis, time_axis, cells_axis) = plt.subplots(3, 1, sharex=True, figsize=(8, 8))
    rss_axis.plot(minutes, [s["rss_bytes"] / 2**20 for s in samples], linewidth=0.8, label="server RSS")
    rss_axis.axhline(summary["rss_at_warmup_bytes"] * (1 + config["max_growth"]) / 2**20, color="red", linestyle=":",
                     label=f"RSS after warm-up + {100 * config['max_growth']:g}%")
    rss_axis.set_ylabel("RSS (MiB)")
    rss_axis.legend(loc="lower right")
    for mode, colour in (("plain", "tab:blue"), ("stream", "tab:green"), ("abandon", "tab:red")):
        chosen = [s for s in samples if s["mode"] == mode and not s["control"]]
        time_axis.scatter([s["elapsed"] / 60 for s in chosen], [s["seconds"] for s in chosen], s=3, color=colour,
                          label={"plain": "turn", "stream": "streamed turn", "abandon": "abandoned stream"}[mode])
    chosen = [s for s in samples if s["control"] and s["mode"] != "abandon" and s["control_turn"] > 2]
    time_axis.scatter([s["elapsed"] / 60 for s in chosen], [s["seconds"] for s in chosen], s=3, color="black",
                      marker="x", label="control (short) conversation")
    time_axis.set_ylabel("seconds per turn")
    time_axis.set_ylim(bottom=0)
    time_axis.legend(loc="upper left", markerscale=3)
    longs = [s for s in samples if not s["control"]]
    cells_axis.plot([s["elapsed"] / 60 for s in longs], [s["cells_used"] for s in longs], linewidth=0.8,
                    label="cells in use")
    cells_axis.axhline(config["budget"], color="red", linestyle=":", label=f"budget {config['budget']}")
    cells_axis.set_ylim(0, config["budget"] * 1.15)
    cells_axis.set_ylabel("KV cells")
    logical_axis = cells_axis.twinx()
    logical_axis.plot([s["elapsed"] / 60 for s in longs], [s["logical_tokens"] for s in longs], color="grey",
                      linewidth=0.8, label="conversation length (tokens)")
    logical_axis.set_ylabel("logical tokens")
    cells_axis.legend(loc="lower right")
    logical_axis.legend(loc="upper left")
    cells_axis.set_xlabel("minutes")
    for axis in (rss_axis, time_axis, cells_axis):
        axis.axvline(config["warmup_minutes"], color="grey", linestyle="--", linewidth=0.8)
    verdict = "PASS" if summary["passed"] else "FAIL"
    fig.suptitle(f"chat server soak, {config['policy']} policy, budget {config['budget']}, {summary['turns']} turns: "
                 f"RSS {100 * summary['rss_growth']:+.1f}%, turn time / control x{summary['length_cost_after_warmup']:.2f}"
                 f" -> x{summary['length_cost_at_end']:.2f} (raw drift {100 * summary['slowdown']:+.0f}%) - {verdict}",
                 fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def verdict(report: Dict[str, Any]) -> str:
    s, budget = report["summary"], report["config"]["budget"]
    return (f"{s['turns']} turns in {s['seconds'] / 60:.1f} min; conversations reached {s['logical_tokens']} tokens; "
            f"RSS {s['rss_at_warmup_bytes'] / 2**20:.1f} MiB after warm-up, peak "
            f"{s['rss_peak_after_warmup_bytes'] / 2**20:.1f} MiB ({100 * s['rss_growth']:+.2f}%); turn "
            f"{s['turn_seconds_after_warmup']:.2f} s after warm-up, {s['turn_seconds_at_end']:.2f} s at the end "
            f"({100 * s['slowdown']:+.0f}%); against the short control conversation x{s['length_cost_after_warmup']:.2f} "
            f"after warm-up, x{s['length_cost_at_end']:.2f} at the end ({100 * s['length_cost_growth']:+.0f}%); max cells {s['max_cells_used']} of {budget}; "
            f"all turns continued: "
            f"{s['all_turns_continued']}: {'PASS' if s['passed'] else 'FAIL'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="benchmarks/results/soak_server.json")
    parser.add_argument("--png", default="benchmarks/results/soak_server.png")
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("-m", "--model", default=None, help="GGUF model (default: the embedded SmolLM2)")
    parser.add_argument("--policy", default="kvp")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--conversations", type=int, default=2)
    parser.add_argument("--reply-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--warmup-minutes", type=float, default=2.0)
    parser.add_argument("--window", type=int, default=30, help="turns in the early and late timing medians")
    parser.add_argument("--max-growth", type=float, default=0.05, help="allowed RSS growth after the warm-up")
    parser.add_argument("--max-slowdown", type=float, default=0.5,
                        help="allowed growth of the ratio of a long conversation's time per turn to the control's")
    parser.add_argument("--kv-conversations", type=int, default=4,
                        help="the server's kv_conversations: saved states kept (each restart of the control "
                             "conversation leaves one behind until the least recently used are dropped)")
    parser.add_argument("--control-restart", type=int, default=20,
                        help="the control conversation starts afresh after this many of its turns")
    parser.add_argument("--print-every", type=int, default=20)
    parser.add_argument("--log", default=None, help="server log file")
    parser.add_argument("--from-json", default=None,
                        help="summarise an earlier run's JSON report again (its samples and config) instead of running")
    args = parser.parse_args()

    if args.from_json:
        with open(args.from_json) as f:
            earlier = json.load(f)
        for name, value in earlier["config"].items():
            if name not in ("command", "machine", "model"):
                setattr(args, name, value)
        summary = earlier["summary"]
        report = summarise(args, earlier["samples"], {"conversations": summary["store"], "kv": summary["kv"]})
        report["config"].update(command=earlier["config"]["command"], machine=earlier["config"]["machine"],
                                model=earlier["config"]["model"])  # fmt: skip
    else:
        report = run(args)
    with open(args.json, "w") as out:
        json.dump(report, out, indent=1)
    plot(report, args.png)
    print(verdict(report) + f"\nwrote {args.json} and {args.png}")
    sys.exit(0 if report["summary"]["passed"] else 1)


if __name__ == "__main__":
    main()
