"""benchmarks/kept_profile.py: the answer-token mask, the per-tenth shares, and a streaming cache's known profile."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import kept_profile  # noqa: E402


def test_answer_mask_marks_every_token_overlapping_an_occurrence():
    pieces = [b"The", b" code", b" is", b" 46", b"123", b"65", b".", b" 4612", b"365", b"!"]
    mask = kept_profile.answer_mask(pieces, ["4612365"])
    # " 46" + "123" + "65" spell " 4612365" (the leading space is outside the match but in the token)
    assert mask.tolist() == [False, False, False, True, True, True, False, True, True, False]
    assert not kept_profile.answer_mask(pieces, ["999"]).any()
    assert not kept_profile.answer_mask(pieces, [""]).any()


def test_profile_shares_per_tenth_and_for_answer_and_other_tokens():
    kept = np.zeros(100, bool)
    kept[:5] = True       # half of the first tenth
    kept[90:] = True      # all of the last
    answer = np.zeros(100, bool)
    answer[[0, 1, 50, 51]] = True
    p = kept_profile.kept_profile(kept, answer)
    assert p["deciles"] == [0.5] + [0.0] * 8 + [1.0]
    assert p["run"] == 7.5  # runs of 5 and 10 tokens
    assert kept_profile.mean_run(np.array([1, 0, 1, 1, 0, 1, 1, 1], bool)) == 2.0
    assert kept_profile.mean_run(np.zeros(4, bool)) == 0.0
    assert p["answer"] == 0.5
    assert p["other"] == pytest.approx(13 / 96)
    assert kept_profile.kept_profile(kept, np.zeros(100, bool))["answer"] is None
    mean = kept_profile.mean_profile([p, kept_profile.kept_profile(~kept, answer)])
    assert mean["deciles"] == [0.5] * 10 and mean["answer"] == 0.5 and mean["samples"] == 2
    assert mean["run"] == (7.5 + 85) / 2  # the complement is one run, tokens 5 to 89


def test_prompt_words_are_a_spaced_letter_token_and_the_letter_tokens_after_it():
    pieces = [b"Find", b" the", b" q", b"zk", b"xab", b" ...", b" q", b"zk", b"xab", b".", b" 12", b" caf\xc3\xa9"]
    assert kept_profile.prompt_words(pieces) == [("the", 1, 2), ("qzkxab", 2, 5), ("qzkxab", 6, 9)]
    assert kept_profile.prompt_words(pieces, end=6) == [("the", 1, 2), ("qzkxab", 2, 5)]
    sample = {"input": "The text.\nQuestion: Which?", "question": "\nQuestion: Which?"}
    split = [b"The", b" text", b".", b"\n", b"Question", b":", b" Which", b"?"]
    assert kept_profile.question_start(sample, split) == 3
    assert kept_profile.question_start({"input": "The text.", "question": ""}, split[:3]) is None


def test_counted_is_whether_the_kept_words_still_rank_the_answer_first():
    # aaaaaa three times, bbbbbb twice: the text ranks aaaaaa first
    words = [("aaaaaa", 0, 2), ("bbbbbb", 2, 4), ("aaaaaa", 4, 6), ("bbbbbb", 6, 8), ("aaaaaa", 8, 10)]
    kept = np.ones(10, bool)
    assert kept_profile.counted_profile(kept, words, ["aaaaaa"]) == {
        "counted": 1.0, "answer whole": 1.0, "other whole": 1.0}
    kept[[1, 5]] = False  # two of aaaaaa's three occurrences lose a token: bbbbbb now leads what is kept whole
    assert kept_profile.counted_profile(kept, words, ["aaaaaa"]) == {
        "counted": 0.0, "answer whole": pytest.approx(1 / 3), "other whole": 1.0}
    assert kept_profile.counted_profile(kept, words, ["aaaaaa", "bbbbbb"])["counted"] == 1.0
    assert kept_profile.counted_profile(kept, words, ["bbbbbb", "cccccc"])["counted"] == 0.5
    mean = kept_profile.mean_profile([
        dict(kept_profile.kept_profile(kept, kept), **kept_profile.counted_profile(kept, words, ["aaaaaa"])),
        kept_profile.kept_profile(kept, kept)])  # a task that does not count has no counted entries
    assert mean["counted"] == 0.0 and mean["answer whole"] == pytest.approx(1 / 3)


def test_streaming_keeps_the_sinks_and_the_newest_tokens(tmp_path):
    from kvp_cpp import Llama, default_model_path

    vocab = Llama(default_model_path(), n_ctx=64, vocab_only=True, verbose=False)
    words = " ".join(["alpha", "beta", "gamma", "delta"] * 60) + " The key is 7731."
    n = len(vocab.tokenize(words.encode(), add_bos=False, special=True))
    tasks = tmp_path / "tasks.jsonl"
    sample = {"task": "planted", "index": 0, "length": n, "input": words, "outputs": ["7731"]}
    tasks.write_text(json.dumps(sample) + "\n")
    budget = 100
    out = tmp_path / "profile.json"
    kept_profile.main(["--tasks", str(tasks), "--policies", "streaming", "--budget", str(budget), "-o", str(out)])
    profile = json.loads(out.read_text())["policies"]["streaming"]["planted"]
    expected = np.zeros(n, bool)
    expected[:4] = True                 # the sinks
    expected[n - (budget - 4):] = True  # and the newest tokens, as many as the rest of the budget
    assert profile["deciles"] == pytest.approx([part.mean() for part in np.array_split(expected, 10)])
    assert profile["answer"] == 1.0     # the key is at the end, inside the recent window
    kept_profile.main(["--tasks", str(tasks), "--policies", "streaming", "--budget", str(budget), "--sink", "30",
                       "-o", str(out)])
    expected[:30] = True
    expected[30:n - (budget - 30)] = False
    assert json.loads(out.read_text())["policies"]["streaming"]["planted"]["deciles"] == pytest.approx(
        [part.mean() for part in np.array_split(expected, 10)])
    with pytest.raises(SystemExit, match="fit the budget"):
        kept_profile.main(["--tasks", str(tasks), "--policies", "streaming", "--budget", str(n)])


def test_samples_per_task_count_by_target_length(tmp_path):
    path = tmp_path / "tasks.jsonl"
    rows = [{"task": t, "index": i, "length": 1900 + i, "target_length": 2048} for t in ("a", "b") for i in range(3)]
    rows.append({"task": "a", "index": 0, "length": 4000, "target_length": 4096})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    picked = kept_profile.load_samples(str(path), 2)
    assert [(s["task"], s["index"], s["target_length"]) for s in picked] == [
        ("a", 0, 2048), ("a", 1, 2048), ("b", 0, 2048), ("b", 1, 2048), ("a", 0, 4096)]
    assert len(kept_profile.load_samples(str(path), None)) == 7


def test_trace_profile_of_a_policy_that_ranks_as_its_target_is_the_oracles():
    rng = np.random.default_rng(0)
    importance = [rng.gamma(0.3, size=(3, 57)) for _ in range(2)]
    p = kept_profile.prefix_profile(importance, [np.log(layer) for layer in importance], 0.25)
    assert p["policy per head"] == p["oracle per head"]
    # the softmax of log-importance is each head's share of it: the shared rankings agree too
    np.testing.assert_allclose(p["policy shared"], p["oracle shared"])
    assert np.mean(p["attention"]) == pytest.approx(1.0)


def test_trace_profile_of_a_newest_first_ranking_keeps_the_last_tenths():
    n = 100
    importance = [np.ones((2, n))]  # attention spread evenly: every tenth holds a tenth of it
    newest_first = [np.tile(np.arange(n, dtype=float), (2, 1))]
    p = kept_profile.prefix_profile(importance, newest_first, 0.3)
    assert p["policy per head"] == [0.0] * 7 + [1.0] * 3
    assert p["policy shared"] == [0.0] * 7 + [1.0] * 3
    assert p["attention"] == pytest.approx([1.0] * 10)
    assert sum(p["oracle shared"]) == pytest.approx(3.0)  # ties: any 30 tokens


def test_trace_mode_runs_a_policy_on_synthetic_traces(tmp_path):
    from kvp_cpp import policy_file
    from training.traces import write_synthetic_traces

    write_synthetic_traces(tmp_path / "traces", n_sequences=2, n_tokens=160, cuts=(80, 120), n_layer=2, n_head_kv=2,
                           head_dim=8, n_future=32)
    identity = dict(arch="synthetic", n_layer=2, n_head_kv=2, head_dim_k=8, head_dim_v=8, n_ctx_train=160)
    policy_file.write_policy(tmp_path / "p.kvp.bin", policy_file.random_policy(**identity, hidden=(4,), seed=1))
    out = tmp_path / "profile.json"
    kept_profile.main(["--traces", str(tmp_path / "traces"), "--policies", str(tmp_path / "p.kvp.bin"),
                       "--kept", "0.5", "-o", str(out)])
    result = json.loads(out.read_text())
    window = result["prefixes"]["window"]
    assert window["count"] == 4 and len(window["policy shared"]) == 10
    # half of the rankable tokens kept, in both modes and by both rankings
    for name in ("oracle per head", "policy per head", "oracle shared", "policy shared"):
        assert np.mean(window[name]) == pytest.approx(0.5, abs=0.02)
    with pytest.raises(SystemExit, match="no prefixes"):
        kept_profile.main(["--traces", str(tmp_path / "traces"), "--policies", str(tmp_path / "p.kvp.bin"),
                           "--documents", "fwe"])
    with pytest.raises(SystemExit, match="between 0 and 1"):
        kept_profile.main(["--traces", str(tmp_path / "traces"), "--policies", str(tmp_path / "p.kvp.bin"),
                           "--kept", "1.5"])


def test_every_sample_is_compressed_from_its_whole_prompt(tmp_path):
    # kv_compress keeps its budget afterwards; a later sample prefilled under it would be evicted while prefilling
    # (the bounded protocol), which for knorm keeps another set than one compression of the whole prompt.
    from kvp_cpp import Llama, default_model_path

    text = " ".join(f"item{i} is {(i * 7919) % 1000}" for i in range(50))
    sample = {"task": "t", "index": 0, "target_length": 1024, "input": text, "outputs": ["item5"]}
    once, twice = tmp_path / "once.jsonl", tmp_path / "twice.jsonl"
    once.write_text(json.dumps(sample) + "\n")
    twice.write_text(json.dumps(sample) + "\n" + json.dumps(dict(sample, index=1)) + "\n")
    profiles = {}
    for path in (once, twice):
        out = tmp_path / (path.stem + ".json")
        kept_profile.main(["--tasks", str(path), "--policies", "knorm", "--budget", "64", "-o", str(out)])
        profiles[path.stem] = json.loads(out.read_text())["policies"]["knorm"]["t"]
    assert profiles["twice"]["samples"] == 2
    assert profiles["twice"]["deciles"] == pytest.approx(profiles["once"]["deciles"])

    # and the protocols do differ for knorm on this prompt, so the check above can fail
    llm = Llama(default_model_path(), n_ctx=1024, kv_policy="knorm", verbose=False)
    tokens = llm.tokenize(text.encode(), add_bos=False, special=True)
    llm.eval(tokens)
    llm.kv_compress(64)
    oneshot = sorted(llm.kv_engine.ledger()["logical"].tolist())
    llm.reset()
    llm.eval(tokens)  # under the budget of 64 kept from the compression
    bounded = sorted(llm.kv_engine.ledger()["logical"].tolist())
    assert oneshot != bounded
