"""Does a fact from turn 1 survive a 30-turn chat under a KV budget? Through the chat server, with the openai client.

For each configuration, the shipped learned policy (kvp) and streaming at --budget cells, and the full cache as a
control (a budget larger than the whole conversation, so that nothing is evicted), starts ``python -m kvp_cpp.server``
on a loopback port and drives --seeds seeded conversations with the official ``openai`` client, interleaved turn by
turn, so that the server's conversation store switches state on every request. Turn 1 says "my locker number is
4821"; turns 2 to 29 talk about other things (seeded topics and phrasings); the last turn asks for the locker
number. A conversation retrieves the fact when the last reply contains 4821. Greedy decoding (temperature 0).
Turns 2 to 29 are small talk ("I really like {topic}.") with 8-token replies; the first and last replies get 16.

Records per turn the response's x-kv-* headers (cells in use, budget, logical tokens, tokens reused and evaluated,
whether the request continued its conversation) and whether the cache still holds the number after it (the tokens
it keeps from turn 1, read in order, spell 4821: GET /kv/cache); per conversation the last turn through which the
number stayed cached; per configuration the counts and /kv/stats.

    python benchmarks/server_retrieval.py [--seeds 5] [--turns 30] [--budget 128] [--max-tokens 8]
                                          [--configs kvp,streaming,full] [--json benchmarks/results/server_retrieval.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from typing import Any, Dict, List, Sequence

from kvp_cpp._llama_lib import child_environment
from kvp_cpp.server.spawn import ServerProcess, environment_threads

NUMBER = "4821"
# SmolLM2-135M-Instruct declines "remember this" requests ("as a chatbot, I don't..."); this one it repeats back.
FACT = f"I just got a new locker at the gym, and my locker number is {NUMBER}. Please repeat my locker number."
QUESTION = "What is my locker number?"
TOPICS = ["the ocean", "mountain hiking", "baking bread", "old castles", "honey bees", "winter sports", "city parks",
          "desert plants", "jazz music", "paper airplanes", "rainy days", "street food", "hot air balloons",
          "tea ceremonies", "lighthouses", "volcanoes", "owls", "train journeys", "chess openings", "gardening",
          "the northern lights", "coral reefs", "medieval maps", "bicycles", "autumn leaves", "glass making",
          "penguins", "public libraries", "kites", "thunderstorms"]  # fmt: skip
# Small talk rather than questions: after 28 instructional questions the 135M model answers the last one in their
# pattern ("A beginner should know that a locker..."), even with the whole conversation cached.
ASKS = ["I really like {}.", "Yesterday I read about {}.", "My friend loves {}.", "I have been thinking about {}.",
        "Today I saw something about {}."]  # fmt: skip


def script(seed: int, turns: int) -> List[str]:
    """The user's messages of one conversation: the fact, seeded small talk, the question."""
    rng = random.Random(seed)
    topics = rng.sample(TOPICS, k=min(len(TOPICS), turns - 2))
    middle = [rng.choice(ASKS).format(topics[i % len(topics)]) for i in range(turns - 2)]
    return [FACT] + middle + [QUESTION]


DEFAULT_CONFIGURATIONS = ("kvp", "streaming", "full")
PER_HEAD = ["--kv-mode", "per_head"]  # served with KVP_CPP_LLAMA=per_head (the patched llama.cpp)


def configurations(budget: int, full_budget: int) -> Dict[str, List[str]]:
    capped = ["--kv-budget", str(budget), "--n_ctx", str(budget)]
    return {
        "kvp": ["--kv-policy", "kvp"] + capped,
        "streaming": ["--kv-policy", "streaming"] + capped,
        # The control: a budget larger than the whole conversation, so the policy never runs.
        "full": ["--kv-policy", "streaming", "--kv-budget", str(full_budget), "--n_ctx", str(full_budget)],
        "kvp_per_head": ["--kv-policy", "kvp"] + capped + PER_HEAD,
        "kvp_chat": ["--kv-policy", "kvp-chat"] + capped,
        "kvp_chat_per_head": ["--kv-policy", "kvp-chat"] + capped + PER_HEAD,
    }


def fact_cached(server, turn_one_end: int) -> bool:
    """Whether the tokens the cache holds from turn 1 (the user's fact and the reply repeating it), read in order,
    spell the number (per head: the tokens that at least one head holds)."""
    cache = server.get("/kv/cache")
    kept = [token for logical, token in zip(cache["logical"], cache["tokens"]) if logical < turn_one_end]
    return NUMBER in server.post("/extras/detokenize", {"tokens": kept})["text"]


def run_configuration(name: str, server_args: List[str], seeds: List[int], turns: int, max_tokens: int,
                      answer_tokens: int, log_path: str = None) -> Dict[str, Any]:  # fmt: skip
    from openai import OpenAI

    start = time.perf_counter()
    with ServerProcess(server_args + environment_threads(), log_path=log_path,
                       env=child_environment("per_head" in server_args)) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        scripts = {seed: script(seed, turns) for seed in seeds}
        messages: Dict[int, List[Dict[str, str]]] = {seed: [] for seed in seeds}
        records: Dict[int, List[Dict[str, Any]]] = {seed: [] for seed in seeds}
        for turn in range(turns):
            for seed in seeds:  # interleaved: every request switches conversation
                messages[seed].append({"role": "user", "content": scripts[seed][turn]})
                last = turn == turns - 1
                long_reply = turn == 0 or last  # the fact's acknowledgement and the answer
                raw = client.chat.completions.with_raw_response.create(
                    model="local", messages=messages[seed], temperature=0, seed=seed,
                    max_tokens=answer_tokens if long_reply else max_tokens)  # fmt: skip
                reply = raw.parse().choices[0].message.content or ""
                messages[seed].append({"role": "assistant", "content": reply})
                headers = {k[len("x-kv-"):]: v for k, v in raw.headers.items() if k.startswith("x-kv-")}
                records[seed].append(dict(turn=turn + 1, reply=reply, **headers))
                # The conversation is live: does its cache still hold turn 1's number?
                records[seed][-1]["fact_cached"] = fact_cached(server, int(records[seed][0]["logical-tokens"]))
        stats = server.get("/kv/stats")
    conversations = []
    for seed in seeds:
        turns_of = records[seed]
        conversations.append({
            "seed": seed, "retrieved": NUMBER in turns_of[-1]["reply"], "answer": turns_of[-1]["reply"],
            "fact_cached": turns_of[-1]["fact_cached"],
            "fact_cached_through_turn": next((r["turn"] - 1 for r in turns_of if not r["fact_cached"]), turns),
            "logical_tokens": int(turns_of[-1]["logical-tokens"]),
            "max_cells_used": max(int(r["cells-used"]) for r in turns_of),
            "continued_turns": sum(r["match"] == "continued" for r in turns_of), "turns": turns_of,
        })  # fmt: skip
    budget = int(records[seeds[0]][-1]["budget"])
    return {"name": name, "server_args": server_args, "budget": budget,
            "retrieved": sum(c["retrieved"] for c in conversations),
            "fact_cached": sum(c["fact_cached"] for c in conversations),
            "fact_cached_through_turn": [c["fact_cached_through_turn"] for c in conversations],
            "conversations": conversations,
            "min_logical_tokens": min(c["logical_tokens"] for c in conversations),
            "max_cells_used": max(c["max_cells_used"] for c in conversations),
            "tokens_evicted": stats["kv"]["tokens_evicted"], "store": stats["conversations"],
            "seconds": time.perf_counter() - start}  # fmt: skip


def run(seeds: List[int], turns: int, budget: int, full_budget: int, max_tokens: int, answer_tokens: int,
        log_dir: str = None, names: Sequence[str] = DEFAULT_CONFIGURATIONS) -> Dict[str, Any]:  # fmt: skip
    known = configurations(budget, full_budget)
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"unknown configurations {unknown}; known: {sorted(known)}")
    results = {}
    for name in names:
        args = known[name]
        log = os.path.join(log_dir, f"server_{name}.log") if log_dir else None
        results[name] = run_configuration(name, args, seeds, turns, max_tokens, answer_tokens, log)
    return {"config": {"seeds": seeds, "turns": turns, "budget": budget, "full_budget": full_budget,
                       "max_tokens": max_tokens, "answer_tokens": answer_tokens, "fact": FACT, "question": QUESTION,
                       "machine": f"{platform.machine()}, {os.cpu_count()} cpus"},
            "results": results}  # fmt: skip


def summary(report: Dict[str, Any]) -> str:
    n = len(report["config"]["seeds"])
    lines = []
    for name, result in report["results"].items():
        lines.append(f"{name:>9} (budget {result['budget']:>4}): retrieved {result['retrieved']}/{n}, number still "
                     f"cached {result['fact_cached']}/{n} (through turn {result['fact_cached_through_turn']}), "
                     f"conversations "
                     f">= {result['min_logical_tokens']} tokens, max cells {result['max_cells_used']}, "
                     f"{result['tokens_evicted']} tokens evicted, {result['seconds']:.0f} s")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5, help="conversations (seeds 0..N-1)")
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--full-budget", type=int, default=2048, help="the control's budget (nothing evicted)")
    parser.add_argument("--max-tokens", type=int, default=8, help="longest reply of turns 2..N-1")
    parser.add_argument("--answer-tokens", type=int, default=16, help="longest reply of the first and last turns")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGURATIONS),
                        help="comma-separated, of kvp, streaming, full, kvp_per_head, kvp_chat, kvp_chat_per_head "
                             "(per head: python -m kvp_cpp.llama_build first)")
    parser.add_argument("--json", default="benchmarks/results/server_retrieval.json")
    args = parser.parse_args()
    report = run(list(range(args.seeds)), args.turns, args.budget, args.full_budget, args.max_tokens,
                 args.answer_tokens, names=args.configs.split(","))  # fmt: skip
    report["config"]["command"] = " ".join(sys.argv)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    print(summary(report))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
