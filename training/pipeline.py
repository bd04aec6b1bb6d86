"""The whole training pipeline in one command: traces, training, held-out evaluation, ONNX export and back.

    python -m training.pipeline --out runs/smollm2                    # the shipped policy's recipe (about 85 min)
    python -m training.pipeline --out runs/x -m other.gguf --objective rl --steps 6000   # then calibrated
    python -m training.pipeline --out runs/gemma3 -m gemma-3-270m-q4_k_m.gguf   # agents for its 3 global layers

The shipped SmolLM2 policy has learned recency terms (--recency-knots 14, the default here); the shipped Gemma 3
policy has none (--recency-knots 0).

A model with sliding-window layers (Gemma 3) gets agents only for the layers that attend to the whole context, and
its policy ranks only tokens older than the window, which the engine always keeps (docs/traces.md).

Steps, each resumable (rerun the same command after an interruption; finished steps are skipped):

1. ``training.capture_traces`` into ``OUT/traces`` (K/V of every layer and the importance targets);
2. ``training.train`` into ``OUT/policy.kvp.bin``, evaluated on the held-out split (``OUT/heldout.json`` and
   ``OUT/heldout.png``);
2b. with ``--calibrate`` (the default for ``--objective rl``, whose scores have an arbitrary scale per agent):
   training writes ``OUT/policy.uncalibrated.kvp.bin`` (evaluated into ``OUT/heldout.uncalibrated.json``), then
   ``training.calibrate`` fits one temperature per agent on the first ``--calibration-prefixes`` training prefixes
   into ``OUT/policy.kvp.bin``, which is evaluated again into ``OUT/heldout.json`` and ``OUT/heldout.png``;
3. ``training.export_onnx`` into ``OUT/policy.onnx``, then ``training.onnx_to_kvp`` back into
   ``OUT/policy.from_onnx.kvp.bin``, which must decode to the same policy (same shapes, same weights).

``OUT/pipeline.json`` records the arguments, each step's wall time and the held-out summary. ``--install PATH``
copies the policy there at the end (for example ``models/smollm2-135m-instruct.kvp.bin``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import numpy as np

from kvp_cpp import policy_file as pf

from . import calibrate, capture_traces, evaluate, export_onnx, onnx_to_kvp
from . import train as train_step


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m training.pipeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="run folder")
    parser.add_argument("-m", "--model", default=None, help="GGUF model (default: the embedded SmolLM2)")
    data = parser.add_argument_group("traces (training.capture_traces)")
    data.add_argument("--ruler", type=int, default=120)
    data.add_argument("--chats", type=int, default=12)
    data.add_argument("--text", type=int, default=10)
    data.add_argument("--length", type=int, default=2048)
    data.add_argument("--cuts", type=int, default=None, help="random cut points per sequence (capture's default: 3)")
    training = parser.add_argument_group("training (training.train)")
    training.add_argument("--objective", choices=train_step.OBJECTIVES, default="listwise")
    training.add_argument("--hidden", default="32")
    training.add_argument("--steps", type=int, default=1000)
    training.add_argument("--seed", type=int, default=0)
    training.add_argument("--recency-knots", type=int, default=14,
                          help="learned recency terms per agent (training.train --recency-knots); 0 for none")
    training.add_argument("--sources", default=None, help="trace sources to train on (default: all)")
    training.add_argument("--train-threads", type=int, default=1, help="torch threads (results depend on it)")
    training.add_argument("--calibrate", choices=("auto", "yes", "no"), default="auto",
                          help="per-agent temperature calibration after training (auto: for --objective rl)")
    training.add_argument("--calibration-prefixes", type=int, default=300,
                          help="training prefixes the temperatures are fitted on")
    parser.add_argument("-t", "--threads", type=int, default=None, help="llama.cpp threads while capturing")
    parser.add_argument("--install", default=None, help="copy the trained policy here at the end")
    return parser.parse_args(argv)


def same_policy(path_a: str, path_b: str) -> bool:
    """The same agents: identity, protected counts, and every stored array of every agent."""
    a, b = pf.read_policy(path_a), pf.read_policy(path_b)

    def shape(p: pf.PolicyData) -> tuple:
        return p.identity(), p.n_sink, p.n_recent, list(p.hidden), p.activation, sorted(p.agents), sorted(p.recency)

    if shape(a) != shape(b):
        return False
    if not all(np.array_equal(values, b.recency[key]) for key, values in a.recency.items()):
        return False
    for key, agent in a.agents.items():
        other = b.agents[key]
        arrays = [agent.shift, agent.scale, *agent.weights, *agent.biases]
        others = [other.shift, other.scale, *other.weights, *other.biases]
        if len(arrays) != len(others) or not all(np.array_equal(x, y) for x, y in zip(arrays, others)):
            return False
    return True


def run(args: argparse.Namespace) -> dict:
    os.makedirs(args.out, exist_ok=True)
    record_path = os.path.join(args.out, "pipeline.json")
    record = {"arguments": vars(args), "seconds": {}}
    if os.path.exists(record_path):
        with open(record_path, encoding="utf-8") as f:
            record["seconds"] = json.load(f).get("seconds", {})

    def step(name: str, action) -> None:
        start = time.time()
        print(f"[pipeline] {name}", file=sys.stderr)
        action()
        record["seconds"][name] = record["seconds"].get(name, 0.0) + time.time() - start
        with open(record_path, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)

    traces = os.path.join(args.out, "traces")
    policy = os.path.join(args.out, "policy.kvp.bin")
    heldout = os.path.join(args.out, "heldout.json")
    plot = os.path.join(args.out, "heldout.png")
    onnx_path = os.path.join(args.out, "policy.onnx")
    back = os.path.join(args.out, "policy.from_onnx.kvp.bin")
    calibrating = args.calibrate == "yes" or (args.calibrate == "auto" and args.objective == "rl")
    trained = os.path.join(args.out, "policy.uncalibrated.kvp.bin") if calibrating else policy
    capture_args = ["--out", traces, "--ruler", str(args.ruler), "--chats", str(args.chats), "--text", str(args.text),
                    "--length", str(args.length), "--seed", str(args.seed)]
    if args.cuts is not None:
        capture_args += ["--cuts", str(args.cuts)]
    if args.model:
        capture_args += ["-m", args.model]
    if args.threads:
        capture_args += ["-t", str(args.threads)]
    sources = ["--sources", args.sources] if args.sources else []
    step("traces", lambda: capture_traces.main(capture_args))  # resumes on its own
    if not os.path.exists(trained):
        step("train", lambda: train_step.main([
            "--traces", traces, "--out", trained, "--objective", args.objective, "--hidden", args.hidden,
            "--steps", str(args.steps), "--seed", str(args.seed), "--recency-knots", str(args.recency_knots),
            "--threads", str(args.train_threads), *sources,
            *(["--resume"] if os.path.exists(trained + ".ckpt") else []),
            "--eval-json", os.path.join(args.out, "heldout.uncalibrated.json") if calibrating else heldout,
            "--eval-plot", os.path.join(args.out, "heldout.uncalibrated.png") if calibrating else plot]))
    if calibrating and not os.path.exists(policy):
        def calibrate_and_evaluate() -> None:
            if calibrate.main(["--traces", traces, "--policy", trained, "--out", policy, *sources,
                               "--max-prefixes", str(args.calibration_prefixes)]) != 0:
                raise SystemExit("pipeline: calibration failed")
            if evaluate.main(["--traces", traces, "--policy", policy, *sources, "--json", heldout,
                              "--plot", plot]) != 0:
                raise SystemExit("pipeline: the held-out evaluation of the calibrated policy failed")
        step("calibrate", calibrate_and_evaluate)

    def export_and_back() -> None:
        for rc in (export_onnx.main([policy, "-o", onnx_path]), onnx_to_kvp.main([onnx_path, "-o", back])):
            if rc != 0:
                raise SystemExit(f"pipeline: the ONNX round trip failed (exit {rc})")
        if not same_policy(policy, back):
            raise SystemExit(f"pipeline: {back} does not hold the same policy as {policy}")

    step("onnx", export_and_back)
    if os.path.exists(heldout):
        with open(heldout, encoding="utf-8") as f:
            result = json.load(f)
        record["heldout_mean_cost"] = {mode: {m: result[mode][m]["mean_over_budgets"] for m in result["methods"]}
                                       for mode in ("per_head", "shared")}
    if args.install:
        os.makedirs(os.path.dirname(os.path.abspath(args.install)), exist_ok=True)
        shutil.copyfile(policy, args.install)
        record["installed"] = args.install
    record["total_seconds"] = sum(record["seconds"].values())
    with open(record_path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    return record


def main(argv=None) -> int:
    record = run(parse_args(argv))
    print(f"[pipeline] done in {record['total_seconds']:.0f} s: {json.dumps(record.get('heldout_mean_cost', {}))}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
