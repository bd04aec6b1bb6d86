"""The chat server (python -m kvp_cpp.server), driven over loopback HTTP with the official openai client.

The long-conversation experiment (benchmarks/server_retrieval.py) runs once per module: three servers (the shipped
policy and streaming at a 128-cell budget, the full cache as a control), five seeded 30-turn conversations each,
interleaved turn by turn. Set KVP_SERVER_RESULTS=PATH to keep its JSON report.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("openai", "fastapi", "uvicorn", "sse_starlette")),
    reason="needs the server and test extras (openai, fastapi, uvicorn, sse-starlette)",
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))  # server_retrieval.py, the experiment's driver

BUDGET = 128
SEEDS = [0, 1, 2, 3, 4]
TURNS = 30
SMALL_BUDGET = 64
MAX_TOKENS = 1024  # kv_max_tokens of the small server: the logical limit


def _client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _post(server, path: str, body: bytes, content_type: str = "application/json"):
    request = urllib.request.Request(server.url + path, data=body, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    import server_retrieval as sr

    logs = str(tmp_path_factory.mktemp("server-logs"))
    report = sr.run(SEEDS, TURNS, BUDGET, 1024, max_tokens=8, answer_tokens=16, log_dir=logs)
    print("\n" + sr.summary(report))
    if os.environ.get("KVP_SERVER_RESULTS"):
        with open(os.environ["KVP_SERVER_RESULTS"], "w") as f:
            json.dump(report, f, indent=1)
    return report


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from kvp_cpp.server.spawn import ServerProcess, environment_threads

    log = str(tmp_path_factory.mktemp("server") / "server.log")
    args = ["--kv-budget", str(SMALL_BUDGET), "--n_ctx", str(SMALL_BUDGET), "--kv-max-tokens", str(MAX_TOKENS),
            "--kv-conversations", "4"] + environment_threads()  # fmt: skip
    with ServerProcess(args, log_path=log) as process:
        yield process


# --- the long conversation ---------------------------------------------------------------------------------------


def test_thirty_turns_far_beyond_the_budget(experiment):
    """Every turn succeeds, the cache never exceeds the budget, and each turn evaluates only its new tokens
    although five conversations alternate on one model."""
    for name in ("kvp", "streaming"):
        result = experiment["results"][name]
        assert result["budget"] == BUDGET
        for conversation in result["conversations"]:
            turns = conversation["turns"]
            assert len(turns) == TURNS
            assert conversation["logical_tokens"] >= 4 * BUDGET
            assert conversation["max_cells_used"] <= BUDGET
            assert turns[0]["match"] in ("new", "forked")  # the five chats begin alike: later ones fork the first
            assert all(turn["match"] == "continued" for turn in turns[1:])
            assert all(int(turn["evaluated-tokens"]) < 64 for turn in turns[1:])  # no re-prefill of the history
        store = result["store"]
        assert store["inconsistent"] == 0 and store["dropped"] == 0
        assert store["restored"] >= len(SEEDS) * (TURNS - 1)  # every request switched conversation
        assert result["tokens_evicted"] > 0
    full = experiment["results"]["full"]
    assert full["tokens_evicted"] == 0  # the control really holds everything


def test_the_fact_from_turn_one(experiment):
    """Retrieval of "my locker number is 4821" in turn 30: the shipped policy, streaming, and the full cache.

    What was measured (benchmarks/results/server_retrieval.json, 10 seeds): the full cache keeps the number through
    all 30 turns and the model answers it in 4 of 10; at 128 cells neither policy still holds it at turn 30 (the
    shipped policy keeps it 5 to 8 turns, streaming 5), so both retrieve it in none. The comparison the issue asks
    for, kvp >= streaming, holds as 0 = 0; the assertions below are the mechanics behind it.
    """
    results = experiment["results"]
    retrieved = {name: results[name]["retrieved"] for name in ("kvp", "streaming", "full")}
    kept = {name: results[name]["fact_cached_through_turn"] for name in ("kvp", "streaming", "full")}
    print(f"\nretrieved over {len(SEEDS)} conversations: {retrieved}; number cached through turn: {kept}")
    assert retrieved["kvp"] >= retrieved["streaming"]
    assert kept["full"] == [TURNS] * len(SEEDS)  # the control holds the fact: a miss there is the model's
    assert all(turns < TURNS for turns in kept["streaming"])  # a sliding window loses it after ~budget tokens
    assert sum(kept["kvp"]) >= sum(kept["streaming"])


# --- one server: streaming, cancellation, errors -----------------------------------------------------------------


def test_streaming_parses_and_the_next_turn_continues(server):
    client = _client(server)
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    chunks = list(client.chat.completions.create(model="local", messages=messages, max_tokens=24, temperature=0,
                                                 stream=True))  # fmt: skip
    assert chunks and all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] in (["stop"], ["length"])
    assert chunks[-1].choices[0].finish_reason is not None
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text.strip()
    stats = chunks[-1].model_extra["kv_stats"]
    assert stats["cells_used"] <= SMALL_BUDGET and stats["match"] == "new"

    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "And two more?"}]
    raw = client.chat.completions.with_raw_response.create(model="local", messages=messages, max_tokens=8,
                                                           temperature=0)  # fmt: skip
    assert raw.parse().choices[0].message.content is not None
    assert raw.headers["x-kv-match"] == "continued"
    assert raw.headers["x-kv-conversation"] == stats["conversation"]
    assert int(raw.headers["x-kv-reused-tokens"]) >= stats["logical_tokens"] - 1


def test_a_cancelled_stream_leaves_the_cache_consistent(server):
    client = _client(server)
    messages = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]
    before = server.get("/kv/stats")
    stream = client.chat.completions.create(model="local", messages=messages, max_tokens=200, temperature=0,
                                            stream=True)  # fmt: skip
    received = []
    for chunk in stream:
        received.append(chunk.choices[0].delta.content or "")
        if len(received) >= 4:
            break
    stream.close()  # the client goes away mid-stream
    for _ in range(600):  # the server notices at its next chunk, closes the generator and records the turn
        cancelled = server.get("/kv/stats")
        if cancelled["conversations"]["requests"] > before["conversations"]["requests"] and not cancelled["in_turn"]:
            break
        time.sleep(0.1)
    assert 1 <= cancelled["last_turn"]["generated_tokens"] < 200  # cut short
    assert cancelled["kv"]["consistent"] and cancelled["conversations"]["inconsistent"] == 0

    partial = "".join(received)
    messages += [{"role": "assistant", "content": partial}, {"role": "user", "content": "Go on, but briefly."}]
    for _ in range(2):  # the conversation goes on from what the client saw; a second client joins meanwhile
        raw = client.chat.completions.with_raw_response.create(model="local", messages=messages, max_tokens=8,
                                                               temperature=0)  # fmt: skip
        assert raw.headers["x-kv-match"] == "continued"  # no client saw the rest of the reply: no fork
        other = client.chat.completions.create(model="local", temperature=0, max_tokens=4,
                                               messages=[{"role": "user", "content": "Say hi."}])  # fmt: skip
        assert other.choices[0].message.content is not None
        messages += [{"role": "assistant", "content": raw.parse().choices[0].message.content},
                     {"role": "user", "content": "Thanks."}]  # fmt: skip
    stats = server.get("/kv/stats")
    assert stats["kv"]["consistent"] and stats["kv"]["cells_used"] <= SMALL_BUDGET
    assert stats["conversations"]["inconsistent"] == 0
    assert stats["conversations"]["conversations"] <= 4  # --kv-conversations


def test_malformed_requests_get_4xx_and_the_server_stays_up(server):
    chat = "/v1/chat/completions"
    hello = [{"role": "user", "content": "hello"}]
    cases = [
        b"{not json",
        json.dumps({"messages": "hello"}).encode(),
        json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}).encode(),
        json.dumps({"messages": hello, "temperature": "hot"}).encode(),
        json.dumps({"messages": hello, "max_tokens": "many"}).encode(),
        json.dumps({"messages": hello, "grammar": "root ::= ("}).encode(),
        json.dumps([1, 2, 3]).encode(),
        json.dumps({"messages": [{"role": "user", "content": None}]}).encode(),  # the template cannot render it
        json.dumps({"messages": hello, "logit_bias": {"999999999": 1.0}}).encode(),
        json.dumps({"messages": hello, "logprobs": True, "top_logprobs": 2}).encode(),  # needs logits_all
    ]
    for body in cases:
        code, _ = _post(server, chat, body)
        assert 400 <= code < 500, body
    code, _ = _post(server, "/v1/completions", json.dumps({"prompt": ["a", "b"]}).encode())
    assert code == 400

    from openai import APIError, BadRequestError

    client = _client(server)
    too_long = [{"role": "user", "content": "word " * (MAX_TOKENS + 100)}]
    with pytest.raises(BadRequestError) as error:
        client.chat.completions.create(model="local", messages=too_long, max_tokens=4)
    assert error.value.code == "context_length_exceeded"
    with pytest.raises(APIError):  # a stream has already answered 200: the error comes as an event
        list(client.chat.completions.create(model="local", messages=too_long, max_tokens=4, stream=True))

    assert server.alive()
    reply = client.chat.completions.create(model="local", messages=hello, max_tokens=4, temperature=0)
    assert reply.choices[0].message.content is not None
    assert server.get("/kv/stats")["kv"]["consistent"]


def test_completions_route_and_stats_endpoint(server):
    client = _client(server)
    first = client.completions.with_raw_response.create(model="local", prompt="Once upon a time", max_tokens=6,
                                                        temperature=0)  # fmt: skip
    text = first.parse().choices[0].text
    second = client.completions.with_raw_response.create(model="local", prompt="Once upon a time" + text + " Then",
                                                         max_tokens=6, temperature=0)  # fmt: skip
    assert first.headers["x-kv-match"] == "new"
    assert second.headers["x-kv-match"] == "continued"
    stats = server.get("/kv/stats")
    assert stats["kv"]["budget"] == SMALL_BUDGET and stats["last_turn"]["match"] == "continued"
    cache = server.get("/kv/cache")
    assert cache["conversation"] == second.headers["x-kv-conversation"]
    assert len(cache["logical"]) == stats["kv"]["cells_used"] and max(cache["logical"]) < cache["logical_tokens"]
    assert server.get("/v1/models")["data"]


# --- per-head mode -----------------------------------------------------------------------------------------------


def test_per_head_mode_serves_interleaved_conversations(tmp_path):
    """--kv-mode per_head with the patched llama.cpp: two conversations alternate turn by turn, far beyond a
    64-cell budget; every turn continues its conversation from the saved per-head state, and no head holds more
    than the budget."""
    from kvp_cpp import _llama_lib
    from kvp_cpp.server.spawn import ServerProcess, environment_threads

    if not _llama_lib.is_built():
        pytest.skip(f"the patched llama.cpp is not built; run `{_llama_lib.BUILD_COMMAND}`")
    args = ["--kv-budget", str(SMALL_BUDGET), "--n_ctx", str(SMALL_BUDGET), "--kv-mode", "per_head",
            "--kv-conversations", "4"] + environment_threads()  # fmt: skip
    with ServerProcess(args, log_path=str(tmp_path / "server.log"), env=_llama_lib.child_environment(True)) as server:
        client = _client(server)
        chats = [[{"role": "user", "content": f"Tell me about the {topic}."}] for topic in ("sea", "mountains")]
        matches = []
        for _turn in range(3):
            for messages in chats:
                raw = client.chat.completions.with_raw_response.create(model="local", messages=messages,
                                                                       max_tokens=24, temperature=0)  # fmt: skip
                reply = raw.parse().choices[0].message.content
                assert reply is not None
                matches.append(raw.headers["x-kv-match"])
                assert int(raw.headers["x-kv-cells-used"]) <= SMALL_BUDGET
                messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Go on."}]
        stats = server.get("/kv/stats")
        cache = server.get("/kv/cache")
        raw = client.chat.completions.with_raw_response.create(model="local", messages=chats[0], max_tokens=48,
                                                               temperature=0)  # fmt: skip
        chats[0] += [{"role": "assistant", "content": raw.parse().choices[0].message.content},
                     {"role": "user", "content": "Go on."}]
        # regenerating the first chat's last reply: a fork that cuts the reply's tokens off again, or, where the heads
        # kept different tokens of it, evaluates the prompt anew
        again = client.chat.completions.with_raw_response.create(model="local", messages=chats[0][:-2],
                                                                 max_tokens=24, temperature=0)  # fmt: skip
        assert again.parse().choices[0].message.content is not None
        after = server.get("/kv/stats")
    assert again.headers["x-kv-match"] == "forked" and int(again.headers["x-kv-cells-used"]) <= SMALL_BUDGET
    assert after["kv"]["consistent"] and after["conversations"]["inconsistent"] == 0
    print(f"\nper-head server store: {after['conversations']}")
    assert after["conversations"]["cut_back"] + after["conversations"]["restarted"] == 1
    kv, store = stats["kv"], stats["conversations"]
    assert kv["kv_mode"] == "per_head" and kv["budget"] == SMALL_BUDGET and kv["cells_used"] <= SMALL_BUDGET
    assert kv["logical_tokens"] > 2 * SMALL_BUDGET and kv["tokens_evicted"] > 0 and kv["consistent"]
    assert store["restored"] >= 4 and store["inconsistent"] == 0
    # the heads keep different tokens: together they hold more than one head's cells
    assert len(cache["logical"]) > kv["cells_used"]


def test_per_head_mode_without_the_patched_library_exits_with_a_message():
    import subprocess

    from kvp_cpp import _llama_lib

    run = subprocess.run([sys.executable, "-m", "kvp_cpp.server", "--kv-mode", "per_head", "--kv-budget", "64",
                          "--n_ctx", "64"], capture_output=True, text=True, timeout=300,
                         env=_llama_lib.child_environment(False))
    assert run.returncode == 2 and "KVP_CPP_LLAMA=per_head" in run.stderr and "Traceback" not in run.stderr


# --- settings and the command line -------------------------------------------------------------------------------


def test_settings_defaults_and_dashed_flags():
    import kvp_cpp
    from kvp_cpp.server.__main__ import underscored
    from kvp_cpp.server.settings import KvpSettings

    settings = KvpSettings()
    assert settings.host == "127.0.0.1" and settings.kv_policy == "kvp"
    assert settings.model == kvp_cpp.default_model_path()
    assert not settings.logits_all and not settings.interrupt_requests
    assert underscored(["--kv-budget", "64", "--kv-policy=streaming", "--model", "a-b.gguf", "--n_ctx", "8"]) == [
        "--kv_budget", "64", "--kv_policy=streaming", "--model", "a-b.gguf", "--n_ctx", "8"]


def test_bad_settings_exit_with_a_message():
    import subprocess

    run = subprocess.run([sys.executable, "-m", "kvp_cpp.server", "--kv-budget", "0"], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2 and "kv_budget" in run.stderr


# --- the conversation store, in process --------------------------------------------------------------------------


def test_conversation_matching():
    from kvp_cpp.server.conversations import Conversation, ConversationStore

    conversation = Conversation(id="a")
    conversation.begin_turn(np.array([1, 2, 3], dtype=np.intc))
    conversation.tokens = np.array([1, 2, 3, 7, 8, 9], dtype=np.intc)  # prompt + reply
    match = lambda *tokens: conversation.match(np.array(tokens, dtype=np.intc))  # noqa: E731
    assert match(1, 2, 3, 7, 8, 9, 4, 5) == 6  # the reply sent back: everything reused
    assert match(1, 2, 3, 7, 8, 5) == 5  # an edited reply: up to the edit
    assert match(1, 2, 3) == 3  # regenerate
    assert match(1, 2, 4, 7) is None and match(1, 2) is None  # not this conversation

    store = ConversationStore(max_conversations=2, max_bytes=1 << 20)
    for name in "abc":
        other = Conversation(id=name)
        other.begin_turn(np.array([ord(name)], dtype=np.intc))
        store.add(other)
        store.enforce_limits()
    assert [c.id for c in store] == ["b", "c"] and store.counters["dropped"] == 1
    assert store.find(np.array([ord("c"), 5], dtype=np.intc))[0].id == "c"
    assert store.find(np.array([5], dtype=np.intc)) == (None, 0)


def test_tokenizing_an_extended_prompt_reuses_the_shared_part(model_path):
    """Reusing a recent prompt's tokens up to a shared control token gives exactly llama.cpp's tokenization."""
    import random

    import llama_cpp
    from kvp_cpp.server.tokens import TokenizationCache, tokenize_with_cache

    vocab = llama_cpp.Llama(model_path, vocab_only=True, verbose=False)
    cache = TokenizationCache(vocab._model.vocab, size=4)  # 2 conversations x 2 add_bos
    rng = random.Random(0)
    pieces = ["the", "sea", " ", "  ", "\n", "\n\n", "école", "日本", "🙂", "a.b", "42", "'s", "<|im_end|>", "<|im_start|>"]
    texts = ["<|im_start|>system\nYou are helpful.<|im_end|>\n", "<|im_start|>system\nBe brief.<|im_end|>\n"]
    total = 0
    for turn in range(40):
        for c in range(2):  # two conversations, interleaved
            role = "user" if turn % 2 == 0 else "assistant"
            texts[c] += f"<|im_start|>{role}\n" + "".join(rng.choice(pieces) for _ in range(rng.randint(1, 60)))
            texts[c] += "<|im_end|>\n"
            prompt = (texts[c] + "<|im_start|>assistant\n").encode()
            for add_bos in (False, True):
                expected = vocab.tokenize(prompt, add_bos, True)
                assert tokenize_with_cache(cache, vocab.tokenize, prompt, add_bos) == expected
                total += len(expected)
    assert cache.reused_tokens > 0.8 * total  # most of every prompt came from the cache


def test_regenerating_after_eviction_cuts_back_and_keeps_both_branches(model_path):
    from conftest import cached_positions
    from kvp_cpp.server.conversations import ConversationLlama

    llm = ConversationLlama(model_path, kv_policy="kvp", kv_budget=48, n_ctx=48, n_threads=2, n_threads_batch=2,
                            verbose=False)  # fmt: skip
    try:
        messages = []
        for question in ["Tell me about owls.", "And about bees?", "And about the sea?"]:
            messages.append({"role": "user", "content": question})
            reply = llm.create_chat_completion(messages, max_tokens=12, temperature=0)["choices"][0]["message"]
            messages.append({"role": "assistant", "content": reply["content"]})
        assert llm.kv_stats()["tokens_evicted"] > 0
        first = llm.last_turn

        # Regenerate the last reply, shorter so that the two branches differ (greedy decoding can write the same
        # reply again, and then the newer branch would be the one continued below).
        again = llm.create_chat_completion(messages[:-1], max_tokens=2, temperature=0)["choices"][0]["message"]
        assert again["content"] != messages[-1]["content"]
        regenerated = llm.last_turn
        assert regenerated["match"] == "forked" and regenerated["conversation"] != first["conversation"]
        assert regenerated["reused_tokens"] == regenerated["prompt_tokens"] - 1
        assert regenerated["evaluated_tokens"] <= 1 + regenerated["generated_tokens"]
        assert llm.conversations.counters["cut_back"] >= 1
        ledger = llm.kv_engine.ledger()
        assert llm.kv_engine.logical_length == llm.n_tokens
        assert sorted(cached_positions(llm).tolist()) == sorted(ledger["cache_pos"].tolist())
        assert ledger["logical"].max() < llm.n_tokens

        # The original branch is still there: sending its reply back continues it, with no re-prefill.
        llm.create_chat_completion(messages + [{"role": "user", "content": "Thanks!"}], max_tokens=4, temperature=0)
        assert llm.last_turn["match"] == "continued" and llm.last_turn["conversation"] == first["conversation"]
        assert llm.last_turn["evaluated_tokens"] < 24
        assert sorted(cached_positions(llm).tolist()) == sorted(llm.kv_engine.ledger()["cache_pos"].tolist())
    finally:
        llm.close()
