"""``python -m kvp_cpp.ruler``: write RULER samples as JSONL."""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from .constants import SYNTHETIC_TASKS, TASKS
from .generators import generate
from .prompt import TEMPLATE_KINDS, LlamaTokenizer


def _csv(kind):
    def parse(text: str):
        return [kind(item) for item in text.split(",") if item.strip()]

    return parse


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m kvp_cpp.ruler", description="Generate RULER long-context tasks sized with a GGUF's tokenizer."
    )
    parser.add_argument(
        "--tasks", type=_csv(str), default=list(SYNTHETIC_TASKS),
        help=f"comma-separated tasks (default: the six synthetic ones). Known: {', '.join(TASKS)}",
    )
    parser.add_argument("--lengths", type=_csv(int), default=[2048, 4096],
                        help="comma-separated target lengths in tokens, generation included (default: 2048,4096)")
    parser.add_argument("--samples", type=int, default=50, help="samples per task and length (default: 50)")
    parser.add_argument("--seed", type=int, default=42, help="random seed (default: 42, as RULER)")
    parser.add_argument("--model", default=None, help="GGUF whose tokenizer and chat template are used "
                        "(default: kvp_cpp.default_model_path())")
    parser.add_argument("--template", choices=TEMPLATE_KINDS, default="chat",
                        help="chat: the model's chat template (default); base: the bare task text")
    parser.add_argument("--interleave", action="store_true",
                        help="write sample 0 of every task and length, then sample 1, ...: a benchmark stopped part "
                             "way through has covered every task evenly")
    parser.add_argument("-o", "--output", default="-", help="output JSONL file (default: stdout)")
    args = parser.parse_args(argv)
    unknown = [task for task in args.tasks if task not in TASKS]
    if unknown:
        parser.error(f"unknown task(s) {', '.join(unknown)}; known: {', '.join(TASKS)}")
    if not args.lengths or args.samples < 1:
        parser.error("need at least one length and one sample")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    model = args.model
    if model is None:
        from kvp_cpp import default_model_path

        model = default_model_path()
    tokenizer = LlamaTokenizer(model)

    out = sys.stdout if args.output == "-" else open(args.output, "w", encoding="utf-8", newline="\n")
    # On a terminal the progress line updates in place; in a log it is one line per task and length.
    interactive = sys.stderr.isatty()
    try:
        jobs = [(task, length) for task in args.tasks for length in args.lengths]
        held: List[List[str]] = []  # --interleave: each job's lines, written round-robin at the end
        for job, (task, length) in enumerate(jobs, 1):
            prefix = f"[ruler {job}/{len(jobs)}] {task} @ {length}"
            held.append([])
            for record in generate(task, length, args.samples, tokenizer, args.template, args.seed):
                line = json.dumps(record, ensure_ascii=False) + "\n"
                if args.interleave:
                    held[-1].append(line)
                else:
                    out.write(line)
                if interactive:
                    done = f"{record['index'] + 1}/{args.samples}"
                    print(f"\r{prefix}: {done} samples", end="", file=sys.stderr, flush=True)
            print(("\r" if interactive else "") + f"{prefix}: {args.samples}/{args.samples} samples", file=sys.stderr)
        for index in range(args.samples if args.interleave else 0):
            for lines in held:
                out.write(lines[index])
    finally:
        if out is not sys.stdout:
            out.close()
    return 0
