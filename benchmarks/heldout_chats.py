"""Held-out chats for kvp-bench's perplexity mode: multi-turn conversations the model writes itself.

The training corpus's chats (training/capture_traces.py, SEED_CHATS) stand in for OASST2; these are generated the
same way from openers and follow-ups that appear nowhere in training, so no policy has seen them. Each chat grows
turn by turn until its rendered text (the model's chat template) holds at least --min-tokens tokens; the output is
JSONL, one {"id", "text"} per chat, which kvp-bench cuts into windows per chat:

    python benchmarks/heldout_chats.py --chats 20 -o heldout_chats.jsonl
    kvp-bench --text heldout_chats.jsonl --ctx 1024 --cont 128 --budgets 256,512 \\
        --policies full,streaming,random,knorm,keydiff,lagkv,kvp

Resumable: chats already in the output file are kept.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Tuple

OPENERS = [
    "I am restoring an old wooden sailboat. Where should I begin?",
    "Can you explain how a violin produces sound?",
    "My sister is visiting Kyoto in autumn. What would you recommend?",
    "How do glaciers carve valleys?",
    "I'd like to start running but my knees hurt. Any advice?",
    "What was daily life like in ancient Rome?",
    "Help me design a board game about trading spices.",
    "How does a compiler turn code into machine instructions?",
    "I keep killing my houseplants. What am I doing wrong?",
    "Explain how honeybees decide where to build a new hive.",
    "What should I know before adopting a rescue dog?",
    "Describe how a tsunami forms and travels.",
    "I'm writing a mystery novel set on a train. Can you help with the plot?",
    "How do noise-cancelling headphones work?",
    "What is the best way to learn to juggle?",
    "Tell me how bread rises.",
    "I need to prepare a five-minute talk about volcanoes.",
    "How did people navigate at sea before GPS?",
    "Can you teach me the basics of chess openings?",
    "What makes a good cup of tea?",
    "How are rainbows formed?",
    "I want to build a birdhouse with my daughter. What do we need?",
    "Explain the rules of cricket to an American.",
    "What causes the northern lights?",
]
FOLLOW_UPS = [
    "Can you go into more detail?",
    "Give me a concrete example.",
    "What is the most common mistake people make here?",
    "Summarise what we have discussed so far.",
    "What did I ask you at the very beginning?",
    "How would you explain that to a ten-year-old?",
    "Is there anything surprising about it?",
    "What should I do next?",
    "Can you list the steps again, briefly?",
    "Why does that work?",
    "What would an expert add?",
    "Thanks. One more question: how long does it usually take?",
]


def make_chat(llm, render, index: int, seed: int, min_tokens: int, reply_tokens: int, max_turns: int
              ) -> Tuple[str, int]:  # fmt: skip
    """The chat's rendered text and its token count."""
    rng = random.Random(seed * 1000 + index)
    messages = [{"role": "user", "content": OPENERS[index % len(OPENERS)]}]
    text, n_tokens = "", 0
    for turn in range(max_turns):
        reply = llm.create_chat_completion(messages, max_tokens=reply_tokens, temperature=0.7,
                                           seed=seed * 1000 + 100 * index + turn)  # fmt: skip
        messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
        text = render(messages)
        n_tokens = len(llm.tokenize(text.encode(), add_bos=False, special=True))
        if n_tokens >= min_tokens:
            break
        messages.append({"role": "user", "content": rng.choice(FOLLOW_UPS)})
    return text, n_tokens


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-o", "--output", required=True, help="JSONL file of chats")
    parser.add_argument("-m", "--model", default=None, help="GGUF (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--chats", type=int, default=20)
    parser.add_argument("--min-tokens", type=int, default=1200, help="grow each chat to at least this many tokens")
    parser.add_argument("--reply-tokens", type=int, default=160)
    parser.add_argument("--max-turns", type=int, default=16, help="assistant replies per chat at most")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("-t", "--threads", type=int, default=None)
    args = parser.parse_args(argv)

    import llama_cpp

    from kvp_cpp import default_model_path
    from kvp_cpp.chat import chat_renderer

    if args.chats > len(OPENERS):
        parser.error(f"--chats is at most {len(OPENERS)} (one opener each)")
    done = set()
    if os.path.exists(args.output):
        with open(args.output, encoding="utf-8") as f:
            done = {json.loads(line)["id"] for line in f if line.strip()}
    llm = llama_cpp.Llama(args.model or default_model_path(), n_ctx=args.min_tokens + 2 * args.reply_tokens + 256,
                          n_threads=args.threads, verbose=False)  # fmt: skip
    render = chat_renderer(llm)
    start = time.time()
    with open(args.output, "a", encoding="utf-8") as out:
        for index in range(args.chats):
            chat_id = f"heldout-chat/{index}"
            if chat_id in done:
                continue
            text, n = make_chat(llm, render, index, args.seed, args.min_tokens, args.reply_tokens, args.max_turns)
            out.write(json.dumps({"id": chat_id, "text": text}) + "\n")
            out.flush()
            print(f"[heldout_chats] {index + 1}/{args.chats}: {n} tokens, {time.time() - start:.0f} s elapsed",
                  file=sys.stderr, flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
