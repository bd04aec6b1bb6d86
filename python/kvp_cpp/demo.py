"""kvp-demo: answer a prompt ~4x longer than the KV cache, under the cache budget, and show what it cost.

A RULER-style needle-in-a-haystack prompt (niah_single_1: a magic number hidden in repeated noise) is answered:
- by llama.cpp with a cache large enough for the whole prompt (the reference),
- by ``kvp_cpp.Llama`` with a cache of ``--budget`` cells, under each policy given with ``--policies``.
For each run it prints the answer, whether it holds the needle, the cache's cells and bytes, and where the engine's
time went (capture callback, copies, scoring, eviction) against the whole run.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

import llama_cpp

from . import Llama, default_model_path, model_identity
from . import policy_file

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


def needle_prompt(llm: llama_cpp.Llama, n_tokens: int, seed: int) -> tuple[str, str]:
    """A niah_single_1 prompt of about n_tokens (chat template applied, answer prefix after the assistant header)."""
    rng = random.Random(seed)
    key, value = rng.choice(["apricot", "lantern", "harbor", "violet"]), str(rng.randint(1_000_000, 9_999_999))
    needle = f"One of the special magic numbers for {key} is: {value}."
    unit = len(llm.tokenize((NOISE + "\n").encode(), add_bos=False))
    n_lines = max(4, (n_tokens - 120) // unit)
    lines = [NOISE] * n_lines
    lines.insert(rng.randrange(n_lines // 5, 4 * n_lines // 5), needle)
    question = (
        "A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you "
        f"about the number afterwards.\n" + "\n".join(lines) +
        f"\nWhat is the special magic number for {key} mentioned in the provided text?"
    )
    template = llm.metadata.get("tokenizer.chat_template")
    if template:
        formatter = llama_cpp.llama_chat_format.Jinja2ChatFormatter(
            template=template, eos_token=llm.detokenize([llm.token_eos()]).decode(errors="ignore"),
            bos_token=llm.detokenize([llm.token_bos()]).decode(errors="ignore"),
        )
        prompt = formatter(messages=[{"role": "user", "content": question}]).prompt
    else:
        prompt = question + "\n"
    return prompt + f" The special magic number for {key} mentioned in the provided text is", value


def run(label: str, llm: llama_cpp.Llama, prompt: str, value: str, max_tokens: int) -> None:
    start = time.perf_counter()
    out = llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0)
    seconds = time.perf_counter() - start
    answer = out["choices"][0]["text"].strip().split("\n")[0]
    found = "found" if value in answer else "missed"
    print(f"\n== {label}: {found} the needle {value} in {seconds:.1f} s ({out['usage']['prompt_tokens']} prompt tokens)")
    print(f"   answer: {answer[:100]!r}")
    if isinstance(llm, Llama) and llm.kv_engine is not None:
        s = llm.kv_stats()
        engine_time = s["callback_seconds"] + s["evict_seconds"]
        print(f"   cells used {s['cells_used']} / budget {s['budget']}  (llama.cpp cells {s['n_ctx_cells']}, "
              f"KV {s['kv_bytes_allocated'] / 2**20:.1f} MiB)")
        print(f"   tokens seen {s['tokens_seen']}, evicted {s['tokens_evicted']} in {s['eviction_rounds']} rounds, "
              f"compactions {s['compactions']}")
        print(f"   engine time {engine_time * 1e3:.1f} ms = {100 * engine_time / seconds:.2f}% of the run: "
              f"callback {s['callback_seconds'] * 1e3:.1f} ms (copies {s['copy_seconds'] * 1e3:.1f}, "
              f"scoring {s['score_seconds'] * 1e3:.1f}), eviction {s['evict_seconds'] * 1e3:.1f} ms")
    else:
        n_cells = llama_cpp.llama_n_ctx(llm.ctx)
        print(f"   full cache: {n_cells} cells")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kvp-demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", default=None, help="GGUF model (default: SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--budget", type=int, default=512, help="KV cache budget in tokens (default 512)")
    parser.add_argument("--length", type=int, default=0, help="prompt length in tokens (default 4x budget)")
    parser.add_argument("--policies", default="streaming,kvp",
                        help="comma-separated: kvp (the shipped learned policy for the model), built-in names, "
                             ".kvp.bin paths, or random-kvp (an untrained random-weight policy, for comparison)")
    parser.add_argument("--no-reference", action="store_true", help="skip the full-cache llama.cpp run")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("-t", "--threads", type=int, default=None)
    args = parser.parse_args(argv)

    model = args.model or default_model_path()
    length = args.length or 4 * args.budget
    common = dict(n_batch=512, verbose=False, n_threads=args.threads)
    tokenizer = llama_cpp.Llama(model, n_ctx=64, verbose=False)
    prompt, value = needle_prompt(tokenizer, length, args.seed)
    print(f"kvp-demo: {os.path.basename(model)}, prompt of {len(tokenizer.tokenize(prompt.encode(), special=True))} tokens, "
          f"KV budget {args.budget} tokens")

    if not args.no_reference:
        run("llama.cpp, full cache", llama_cpp.Llama(model, n_ctx=length + 256, **common), prompt, value, 12)
    with tempfile.TemporaryDirectory() as tmp:
        for policy in filter(None, args.policies.split(",")):
            labels = {"kvp": "KVP, the shipped learned policy", "kvp-chat": "KVP chat, the shipped chat policy"}
            label = labels.get(policy, policy)
            if policy == "random-kvp":
                path = os.path.join(tmp, "random.kvp.bin")
                policy_file.write_policy(path, policy_file.random_policy(**model_identity(model), hidden=(32,)))
                policy, label = path, "KVP scorer, random untrained weights"
            llm = Llama(model, n_ctx=args.budget, kv_policy=policy, **common)
            run(f"kvp_cpp budget {args.budget}, {label}", llm, prompt, value, 12)
            llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
