"""benchmarks/kept_set_criteria.py: each criterion against a brute-force reference, the agreement count, and a live
run whose streaming kept sets are known."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import kept_set_criteria as criteria  # noqa: E402


def test_lost_share_is_the_evicted_part_of_each_heads_attention_averaged():
    importance = np.array([[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 5.0, 5.0]])
    kept = np.array([True, False, True, False])
    assert criteria.lost_share(importance, kept) == pytest.approx((6 / 10 + 5 / 10) / 2)
    assert criteria.lost_share(importance, np.ones(4, bool)) == 0.0
    assert criteria.lost_share(importance, np.zeros(4, bool)) == pytest.approx(1.0)


def test_output_error_masks_renormalises_and_compares_per_query_head():
    rng = np.random.default_rng(3)
    m, n_head, n_kv, n, d = 3, 4, 2, 9, 5
    logits = rng.normal(size=(m, n_head, n))
    weights = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    values = rng.normal(size=(n, n_kv, d))
    visible = rng.random(n) < 0.6
    visible[0] = True
    errors = []
    for j in range(m):  # one query and one query head at a time, written out
        for h in range(n_head):
            v = values[:, h // (n_head // n_kv)]
            full = sum(weights[j, h, i] * v[i] for i in range(n))
            z = sum(weights[j, h, i] for i in range(n) if visible[i])
            kept = sum(weights[j, h, i] / z * v[i] for i in range(n) if visible[i])
            errors.append(np.linalg.norm(kept - full) / np.linalg.norm(full))
    assert criteria.output_error(weights, values, visible) == pytest.approx(np.mean(errors), rel=1e-12)
    assert criteria.output_error(weights, values, np.ones(n, bool)) == pytest.approx(0.0, abs=1e-12)


def test_agreement_counts_pairs_whose_scores_differ_and_halves_ties():
    def record(policy, index, score, lost, output, nll, task="fwe"):
        return {"task": task, "index": index, "budget": 128, "policy": policy, "score": score,
                "lost": lost, "output": output, "nll": nll}

    records = [
        record("a", 0, 66.7, 0.2, 0.1, 1.0), record("b", 0, 33.3, 0.1, 0.2, 2.0),   # lost wrong, others right
        record("a", 1, 0.0, 0.3, 0.3, 3.0), record("b", 1, 100.0, 0.1, 0.3, 2.0),   # lost right, output tied
        record("a", 2, 50.0, 0.1, 0.1, 1.0), record("b", 2, 50.0, 0.2, 0.2, 2.0),   # same score: not counted
        record("a", 0, 100.0, 0.1, 0.1, 1.0, task="niah"), record("b", 0, 0.0, 0.2, 0.2, 2.0, task="niah"),
        record("c", 0, None, 0.0, 0.0, 0.0, task="niah"),                           # no score: not counted
    ]
    result = criteria.agreement(records)
    assert result["fwe"] == {"pairs": 2, "lost": 0.5, "output": 0.75, "nll": 1.0}
    assert result["niah"] == {"pairs": 1, "lost": 1.0, "output": 1.0, "nll": 1.0}
    assert result["all"] == {"pairs": 3, "lost": 2 / 3, "output": 2.5 / 3, "nll": 1.0}
    assert criteria.policy_label("kvp:/some/dir/kvp-recency.kvp.bin") == "kvp:kvp-recency.kvp.bin"
    assert criteria.policy_label("keydiff") == "keydiff"
    scores = {("kvp:/runs/p.kvp.bin", "fwe", 0, 128): 1.0, ("kvp:q.kvp.bin", "fwe", 0, 128): 2.0}
    sample = {"task": "fwe", "index": 0}
    assert criteria.score_of(scores, "kvp:/runs/p.kvp.bin", sample, 128) == 1.0   # as given
    assert criteria.score_of(scores, "kvp:/elsewhere/q.kvp.bin", sample, 128) == 2.0  # by file name
    assert criteria.score_of(scores, "kvp:/runs/p.kvp.bin", sample, 512) is None


def test_scores_come_from_shared_records_of_the_evict_unit_without_sink_or_stretch(tmp_path):
    base = {"policy": "keydiff", "task": "fwe", "index": 0, "budget": 128, "kv_mode": "shared", "evict_unit": "word"}
    rows = [dict(base, score=10.0), dict(base, score=20.0, kv_mode="per_head"), dict(base, score=30.0, sink=300),
            dict(base, score=40.0, stretch=2.0), dict(base, score=50.0, evict_unit="token", index=1)]
    log = tmp_path / "log.samples.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    assert criteria.load_scores([str(log)], "word") == {("keydiff", "fwe", 0, 128): 10.0}
    assert criteria.load_scores([str(log)], "token") == {("keydiff", "fwe", 1, 128): 50.0}


def test_live_run_measures_streaming_kept_sets(tmp_path):
    from kvp_cpp import Llama, default_model_path

    vocab = Llama(default_model_path(), n_ctx=64, vocab_only=True, verbose=False)
    text = " ".join(["alpha", "beta", "gamma", "delta"] * 40) + " The key is 7731. What is the key?"
    sample = {"task": "planted", "index": 0, "input": text, "answer_prefix": " The key is", "outputs": ["7731"]}
    n = len(vocab.tokenize((text + sample["answer_prefix"]).encode(), add_bos=False, special=True))
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(sample) + "\n")
    log = tmp_path / "scores.samples.jsonl"
    log.write_text("".join(json.dumps({"policy": p, "task": "planted", "index": 0, "budget": b, "score": s,
                                       "evict_unit": "token"}) + "\n"
                           for p, b, s in (("streaming", 40, 0.0), ("streaming", 120, 100.0))))
    out = tmp_path / "criteria.json"
    criteria.main(["--tasks", str(tasks), "--policies", "streaming", "--budgets", "120,40", "--evict-unit", "token",
                   "--scores", str(log), "-o", str(out)])
    result = json.loads(out.read_text())
    small, large = sorted(result["records"], key=lambda r: r["budget"])
    assert (small["kept"], large["kept"]) == (40, 120)
    # streaming's larger set holds the smaller one, so less of the answer's attention falls on evicted tokens
    assert 0.0 < large["lost"] < small["lost"] < 1.0
    assert small["output"] > 0.0 and large["output"] > 0.0
    assert np.isfinite([small["nll"], large["nll"], small["nll_full"]]).all()
    assert small["nll_full"] == large["nll_full"]
    assert (small["score"], large["score"]) == (0.0, 100.0)
    assert result["agreement"] == {}  # one policy: no pairs to compare
    # a second run resumes from the file: nothing left to measure, nothing measured twice
    criteria.main(["--tasks", str(tasks), "--policies", "streaming", "--budgets", "40,120", "--evict-unit", "token",
                   "--scores", str(log), "-o", str(out)])
    assert json.loads(out.read_text())["records"] == result["records"]
    with pytest.raises(SystemExit, match="another run"):
        criteria.main(["--tasks", str(tasks), "--policies", "streaming", "--budgets", "40", "--evict-unit", "token",
                       "-o", str(out)])
    with pytest.raises(SystemExit, match="fit the budget"):
        criteria.main(["--tasks", str(tasks), "--policies", "streaming", "--budgets", str(n - 1)])
