"""benchmarks/oracle_perplexity.py: the oracle's token sets against brute force, and its protocol against kvp-bench's."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import oracle_perplexity as oracle  # noqa: E402


def test_oracle_keeps_each_heads_top_tokens_and_the_shared_sum_of_shares():
    rng = np.random.default_rng(3)
    L, H, n, budget = 2, 3, 60, 31
    importance = rng.gamma(0.5, size=(L, H, n))
    importance[0, 0, 7] = 1e6  # in the shared sum this counts as one head's share (about 1), not as 1e6
    per_head, shared = oracle.oracle_keep(importance, budget)
    k = budget - oracle.N_SINK - oracle.N_RECENT
    rankable = range(oracle.N_SINK, n - oracle.N_RECENT)
    for il in range(L):
        for ih in range(H):
            best = sorted(rankable, key=lambda j: -importance[il, ih, j])[:k]
            assert sorted(per_head[il, ih].tolist()) == sorted(best)
    share = {j: sum(importance[il, ih, j] / importance[il, ih].sum() for il in range(L) for ih in range(H))
             for j in rankable}
    assert sorted(shared.tolist()) == sorted(sorted(rankable, key=lambda j: -share[j])[:k])


def test_observed_importance_is_the_mean_attention_from_the_last_prefilled_queries():
    rng = np.random.default_rng(5)
    n, n_head, n_head_kv, d, observe, scale = 23, 6, 2, 8, 7, 0.35
    q, k = rng.normal(size=(n, n_head, d)), rng.normal(size=(n, n_head_kv, d))
    got = oracle.observed_importance(q, k, n, observe, scale)
    group = n_head // n_head_kv
    expected = np.zeros((n_head_kv, n))
    for g in range(n_head_kv):
        for i in range(n):
            received = []
            for j in range(max(i, n - observe), n):  # the observed queries that can see token i
                best = 0.0
                for h in range(g * group, (g + 1) * group):
                    logits = [float(q[j, h] @ k[t, g]) * scale for t in range(j + 1)]
                    top = max(logits)
                    best = max(best, np.exp(logits[i] - top) / sum(np.exp(x - top) for x in logits))
                received.append(best)
            expected[g, i] = sum(received) / len(received)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=0)


def test_evicted_is_the_complement_of_kept_and_protected():
    rng = np.random.default_rng(4)
    L, H, n, k = 3, 2, 50, 9
    rankable = np.arange(oracle.N_SINK, n - oracle.N_RECENT)
    keep = np.stack([np.stack([rng.choice(rankable, k, replace=False) for _ in range(H)]) for _ in range(L)])
    drop = oracle.evicted(keep, n)
    assert drop.shape == (L, H, n - k - oracle.N_SINK - oracle.N_RECENT) and drop.dtype == np.int32
    protected = set(range(oracle.N_SINK)) | set(range(n - oracle.N_RECENT, n))
    for il in range(L):
        for ih in range(H):
            dropped, kept = set(drop[il, ih].tolist()), set(keep[il, ih].tolist())
            assert not dropped & (kept | protected)
            assert dropped | kept | protected == set(range(n))


def test_budgets_outside_the_window_are_refused(capsys):
    with pytest.raises(SystemExit):
        oracle.parse_args(["--text", "x.jsonl", "--ctx", "256", "--budgets", "300", "-o", "x.jsonl"])
    assert "budget 300" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        oracle.parse_args(["--text", "x.jsonl", "--ctx", "256", "--budgets", "64", "--observe", "256", "-o", "x.jsonl"])
    assert "--observe 256" in capsys.readouterr().err


def test_check_refuses_a_log_evicted_by_whole_words(tmp_path):
    """--check compares token-level eviction only; a log whose streaming ran with kvp-bench's default unit (words)
    is an error naming the series and the flag, not a check of `full` alone."""
    def record(policy, budget, score, **extra):
        return {"protocol": "oneshot", "policy": policy, "budget": budget, "index": 0, "score": score, **extra}

    ours = [record("full", None, 2.0), record("streaming", 64, 3.0)]
    log = tmp_path / "bench.samples.jsonl"
    log.write_text("\n".join(json.dumps(r) for r in [record("full", None, 2.0),
                                                      record("streaming", 64, 3.5, evict_unit="word")]))
    with pytest.raises(SystemExit, match=r"streaming 64 records were evicted by whole words.*--evict-unit token"):
        oracle.check_against(ours, str(log))
    log.write_text("\n".join(json.dumps(r) for r in [record("full", None, 2.0),
                                                      record("streaming", 64, 3.5, evict_unit="word"),
                                                      record("streaming", 64, 3.25)]))
    assert oracle.check_against(ours, str(log)) == {"full": 0.0, "streaming 64": 0.25}
    log.write_text(json.dumps(record("full", None, 2.0, index=5)))
    with pytest.raises(SystemExit, match="no oneshot full or streaming record"):
        oracle.check_against(ours, str(log))


def test_full_and_streaming_match_kvp_bench_on_the_same_window(tmp_path):
    """The script's own full and streaming runs, through per-head eviction on the patched library, give kvp-bench's
    NLL on the same window (same tokens, positions and protocol); the oracle's records are kvp-bench's records."""
    from kvp_cpp import _llama_lib

    if not _llama_lib.is_built():
        pytest.skip(f"the patched llama.cpp is not built; run `{_llama_lib.BUILD_COMMAND}`")
    text = tmp_path / "chats.jsonl"
    with open(os.path.join(REPO, "benchmarks", "results", "heldout_chats.jsonl"), encoding="utf-8") as f:
        text.write_text(f.readline())
    env = _llama_lib.child_environment(False)
    bench = subprocess.run([sys.executable, "-m", "kvp_cpp.bench", "--text", str(text), "--ctx", "256", "--cont", "32",
                            "--budgets", "64", "--policies", "full,streaming", "--evict-unit", "token",
                            "--samples", "1", "-t", "2", "-o", str(tmp_path / "bench.json")],
                           capture_output=True, text=True, timeout=600, env=env)
    assert bench.returncode == 0, bench.stderr[-3000:]
    out = tmp_path / "oracle.samples.jsonl"
    run = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "oracle_perplexity.py"), "--text", str(text),
                          "--ctx", "256", "--cont", "32", "--budgets", "64", "--samples", "1", "-t", "2",
                          "-o", str(out), "--check", str(tmp_path / "bench.samples.jsonl")],
                         capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    line = [l for l in run.stdout.splitlines() if l.startswith("largest |NLL difference|")][0]
    worst = dict(item.rsplit(" ", 1) for item in line.split(": ", 1)[1].split(", "))
    assert set(worst) == {"full", "streaming 64"}
    assert all(float(v) < 1e-4 for v in worst.values()), line  # equal to rounding in practice
    records = [json.loads(l) for l in out.read_text().splitlines()]
    oracles = {(r["policy"], r["kv_mode"]): r for r in records if r["policy"].startswith("oracle")}
    assert set(oracles) == {(name, mode) for name in oracle.ORACLES for mode in ("shared", "per_head")}
    observed = [r for r in records if r["policy"] == "observed"]
    assert {r["kv_mode"] for r in observed} == {"shared", "per_head"} and all(r["observe"] == 32 for r in observed)
    full = next(r["score"] for r in records if r["policy"] == "full")
    for r in list(oracles.values()) + observed:
        assert r["compressed_cells"] == 64 and r["task"] == "ppl:chats" and r["metric"] == "mean_nll"
        assert np.isfinite(r["score"]) and r["score"] > 0.5 * full
