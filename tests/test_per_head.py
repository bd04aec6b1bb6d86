"""Per-head KV eviction on the patched llama.cpp (kvp_cpp/llama_patches, built by ``python -m kvp_cpp.llama_build``).

Every check runs in a fresh process (tests/per_head_probe.py), because a process loads one libllama for good: the
patched one with ``KVP_CPP_LLAMA=per_head``, llama-cpp-python's own without. Skipped, with the reason, when the
patched library is not built.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from kvp_cpp import _llama_lib

PROBE = pathlib.Path(__file__).with_name("per_head_probe.py")

pytestmark = pytest.mark.skipif(
    not _llama_lib.is_built(),
    reason=f"the patched llama.cpp is not built ({_llama_lib.lib_dir()}); run `{_llama_lib.BUILD_COMMAND}`",
)


def run_probe(scenario: str, args=None, *, patched: bool, timeout: float = 300):
    out = subprocess.run([sys.executable, str(PROBE), scenario, json.dumps(args or {})],
                         env=_llama_lib.child_environment(patched),
                         capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise AssertionError(f"probe {scenario} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


GREEDY = {"n_new": 16, "chunk": 64, "repeat": 3}


@pytest.fixture(scope="module", params=[True, False], ids=["fa_on", "fa_off"])
def greedy_runs(request):
    """Greedy tokens and a hash of all logits, on the stock library and on the patched one (per-head mode off,
    enabled before the first token, enabled after 64 tokens)."""
    args = dict(GREEDY, flash_attn=request.param)
    stock = run_probe("greedy", args, patched=False)
    patched = run_probe("greedy", dict(args, enable_at=[None, 0, 64]), patched=True)
    return stock, patched


def test_patched_library_is_bit_identical_to_stock(greedy_runs):
    """llama-cpp-python on the patched library: the same greedy tokens and the same logits, bit for bit."""
    stock, patched = greedy_runs
    assert not stock["patched"] and patched["patched"]
    assert patched["lib"] == str(_llama_lib.lib_dir())
    ref, off = stock["runs"][0], patched["runs"][0]
    assert ref["n_prompt"] > 64 and not off["per_head_enabled"]
    assert off["tokens"] == ref["tokens"]
    assert off["logits_sha256"] == ref["logits_sha256"]


def test_per_head_without_eviction_is_bit_identical_to_stock(greedy_runs):
    """Per-head mode with the budget above the token count, enabled before the first token or after 64: the stock
    library's greedy tokens and logits, bit for bit."""
    stock, patched = greedy_runs
    ref = stock["runs"][0]
    for run in patched["runs"][1:]:
        assert run["per_head_enabled"], run
        assert run["tokens"] == ref["tokens"]
        assert run["logits_sha256"] == ref["logits_sha256"]


@pytest.mark.parametrize("flash_attn", [True, False])
def test_planted_token_survives_in_its_own_head(flash_attn):
    """Each (layer, KV head) keeps sinks, recent tokens and one planted token of its own and drops the rest:
    the cache reports exactly that set per head, and each row still holds that head's K/V for that position."""
    r = run_probe("planted", {"flash_attn": flash_attn}, patched=True)
    assert r["n_distinct_planted"] > 50  # the heads really keep different tokens
    assert r["kept_ok"]
    assert r["bad_rows"] == 0
    assert {c for row in r["counts"] for c in row} == {4 + 1 + 16}
    assert r["shared_cells"] == 21  # llama.cpp's own cells: the same count
    assert r["shared_pos_max"] == r["n_prompt"] - 1
    assert r["finite"]
    assert {c for row in r["counts_after_decode"] for c in row} == {21 + 8}


def test_answer_likelihood_evicts_per_head():
    """training.likelihood's reward on a per-head context: nothing removed, the same set removed per head and by
    seq_rm give llama.cpp's same NLL; every head keeping its own set gives another, reproducibly from the saved
    prefill, with every head holding kept + decoded cells; unequal kept counts are refused."""
    r = run_probe("answer_likelihood", patched=True)
    assert r["full"] == r["full_per_head"] == r["full_per_head_again"]
    assert abs(r["same_per_head"] - r["same_seq_rm"]) < 1e-4
    assert abs(r["same_seq_rm"] - r["full"]) > 1e-2  # the eviction matters to the answer
    assert r["own"][0] == r["own"][1] and abs(r["own"][0] - r["same_per_head"]) > 1e-3
    assert {c for row in r["counts_after_own"] for c in row} == {r["n_kept"] + r["n_tail"]}
    assert np.shape(r["counts_after_own"]) == (r["n_layer"], r["n_head"])
    assert "as many tokens" in r["unequal_error"]


def test_end_to_end_fine_tuning_per_head(tmp_path):
    """python -m training.e2e --kv-mode per_head, started on the stock library, restarts itself on the patched one,
    draws a kept set per head and writes a loadable policy whose weights moved; a policy lacking a head is refused."""
    pytest.importorskip("torch")
    from kvp_cpp import _core
    from kvp_cpp import policy_file as pf

    init, out = tmp_path / "init.kvp.bin", tmp_path / "e2e.kvp.bin"
    pf.write_policy(init, pf.random_policy(hidden=(4,), seed=3))
    run = [sys.executable, "-m", "training.e2e", "--init", str(init), "--tasks", "niah_single_1",
           "--samples-per-task", "1", "--length", "512", "--budgets", "128", "--steps", "2", "--samples", "3",
           "--quiet", "-t", "2", "--kv-mode", "per_head"]
    root = pathlib.Path(__file__).resolve().parents[1]
    done = subprocess.run(run + ["--out", str(out)], cwd=root, env=_llama_lib.child_environment(False),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    before, after = pf.read_policy(init), pf.read_policy(out)
    assert after.metadata["e2e"]["kv_mode"] == "per_head"
    assert np.isfinite([after.metadata["e2e"][f"greedy_nll_{when}"] for when in ("before", "after")]).all()
    assert any(not np.array_equal(after.agents[s].weights[0], before.agents[s].weights[0]) for s in before.agents)
    _core.load_policy(str(out))
    partial = tmp_path / "partial.kvp.bin"
    pf.write_policy(partial, pf.random_policy(hidden=(4,), seed=3, layer_scored=[layer != 7 for layer in range(30)]))
    refused = subprocess.run(run[:run.index("--init") + 1] + [str(partial)] + run[run.index("--init") + 2:] +
                             ["--out", str(tmp_path / "x.kvp.bin")], cwd=root,
                             env=_llama_lib.child_environment(True), capture_output=True, text=True, timeout=600)
    assert refused.returncode != 0 and "no agent for 3 (layer, KV head)" in refused.stderr, refused.stderr[-2000:]


@pytest.mark.parametrize("flash_attn", [True, False])
def test_attention_depends_on_each_heads_tokens_not_on_their_cells(flash_attn):
    """Per-head token sets (different for each of the 90 heads) reached in two orders, so that every head's rows
    sit in other cells: layer 0's attention output for 16 new tokens agrees up to rounding (flash attention
    accumulates V in F16), while the evictions themselves change it far more (control: no eviction)."""
    r = run_probe("order", {"flash_attn": flash_attn}, patched=True)
    assert r["same_sets"] and r["expected_sets"]
    assert r["heads_laid_out_differently"] == 90
    assert r["n_captured"] == 16
    assert r["rel_diff"] < (5e-3 if flash_attn else 1e-5), r
    assert r["control_rel_diff"] > max(0.02, 10 * r["rel_diff"]), r


def test_every_head_stays_within_budget_on_a_long_stream():
    """~4x the cache through a 256-cell context: every head's cell count, read from the cache, stays <= 256;
    the moved rows keep their K/V; decoding stays finite."""
    r = run_probe("budget", {"n_ctx": 256, "chunk": 32, "repeat": 16, "flash_attn": True}, patched=True)
    assert r["n_cells"] == 256
    assert r["n_tokens"] > 3 * r["n_cells"]
    assert r["evictions"] > 10 and r["row_checks"] > 2
    assert r["max_count"] <= r["n_cells"]
    assert {c for row in r["final_counts"] for c in row} == {r["shared_cells"]}
    assert r["shared_pos_max"] == r["n_tokens"] - 1
    assert r["finite"]


def test_seq_rm_and_refused_evictions():
    r = run_probe("seq_rm", patched=True)
    assert r["unequal"] is False  # heads hold different counts in [0, 50): refused, nothing changed
    assert {c for row in r["counts_after_refusal"] for c in row} == {130}
    assert r["tail"] is True
    assert {c for row in r["counts_after_tail"] for c in row} == {120}
    assert r["pos_max"] == 149
    assert r["bad_evict"] and "does not hold" in r["bad_evict"]
    assert r["counts_after_bad"] == r["counts_after_tail"]
    assert r["everything"] is True
    assert {c for row in r["counts_after_clear"] for c in row} == {0}


def test_shared_engine_unchanged_on_the_patched_library():
    """kvp-cpp's shared-cell engine (keydiff, prompt ~4x a 256-cell budget) gives the same text and counters on
    the patched library as on the stock one."""
    stock = run_probe("engine", {"policy": "keydiff"}, patched=False)
    patched = run_probe("engine", {"policy": "keydiff"}, patched=True)
    assert patched["patched"] and not stock["patched"]
    assert stock["tokens_evicted"] > 500
    assert patched == dict(stock, patched=True)


KVP_FILE = pathlib.Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct.kvp.bin"


@pytest.mark.parametrize("policy", ["keydiff", str(KVP_FILE)], ids=["keydiff", "kvp"])
def test_engine_per_head_mode(policy):
    """kvp_cpp.Llama(kv_mode="per_head"), each head by its own scores (consensus 0): a prompt ~4x a 256-cell budget;
    every head's cell count, read from the cache, is the engine's cells_used <= budget, and the 90 heads keep 90
    different token sets."""
    r = run_probe("engine_per_head", {"policy": policy, "consensus": 0.0}, patched=True)
    assert r["n_cells"] == 256 and r["tokens_evicted"] > 500
    assert r["counts"] == [r["cells_used"]] and r["cells_used"] <= 256
    assert r["n_distinct_sets"] == 90
    assert r["max_pos"] > 900  # original positions
    assert len(r["text"].strip()) > 0


def test_engine_per_head_with_token_level_policy_is_the_shared_engine():
    """A one-column policy (streaming) scores every head alike: per-head mode evicts the same tokens from every
    head and produces what the shared engine produces (original positions in both)."""
    args = {"policy": "streaming", "position_mode": "original"}
    shared = run_probe("engine_per_head", dict(args, kv_mode="shared"), patched=True)
    per = run_probe("engine_per_head", dict(args, kv_mode="per_head"), patched=True)
    assert per["n_distinct_sets"] == 1
    assert per["text"] == shared["text"]
    assert (per["tokens_evicted"], per["cells_used"]) == (shared["tokens_evicted"], shared["cells_used"])


def test_head_consensus_moves_per_head_eviction_towards_shared():
    """kv_head_consensus=1 ranks every head by shared mode's vote: from the same start every head keeps the same
    tokens and the text is the shared engine's (original positions in both). 0.5 keeps heads apart, but fewer
    distinct token sets than 0. Unset, it is the documented default in per-head mode and 0 in shared mode."""
    args = {"policy": str(KVP_FILE), "position_mode": "original"}
    shared = run_probe("engine_per_head", dict(args, kv_mode="shared"), patched=True)
    full = run_probe("engine_per_head", dict(args, consensus=1.0), patched=True)
    half = run_probe("engine_per_head", dict(args, consensus=0.5), patched=True)
    default = run_probe("engine_per_head", args, patched=True)
    assert (shared["head_consensus"], half["head_consensus"], default["head_consensus"]) == (0.0, 0.5, 0.9)
    assert 1 < default["n_distinct_sets"] < 90 and default["counts"] == [default["cells_used"]]
    assert full["n_distinct_sets"] == 1
    assert full["text"] == shared["text"]
    assert (full["tokens_evicted"], full["cells_used"]) == (shared["tokens_evicted"], shared["cells_used"])
    assert 1 < half["n_distinct_sets"] <= 90 and half["counts"] == [half["cells_used"]]


def test_engine_per_head_without_eviction_is_stock():
    """Budget above the token count: kv_mode="per_head" gives stock llama-cpp-python's greedy text."""
    stock = run_probe("engine_per_head", {"policy": None, "budget": 1024, "repeat": 3}, patched=False)
    per = run_probe("engine_per_head", {"policy": "keydiff", "budget": 1024, "repeat": 3}, patched=True)
    assert per["tokens_evicted"] == 0 and per["n_distinct_sets"] == 1
    assert per["text"] == stock["text"]


def test_kv_mode_errors():
    stock = run_probe("kv_mode_errors", patched=False)
    assert stock["per_head"].startswith("RuntimeError") and "KVP_CPP_LLAMA=per_head" in stock["per_head"]
    assert stock["per_head_compact"].startswith("ValueError") and "original" in stock["per_head_compact"]
    assert stock["bogus"].startswith("ValueError") and "kv_mode" in stock["bogus"]
    patched = run_probe("kv_mode_errors", patched=True)
    assert patched["per_head"] is None


@pytest.mark.parametrize("policy", ["kvp", "keydiff"])
def test_per_head_state_round_trip(policy):
    """save_state/load_state in per-head mode: every head's positions come back (in the same Llama and in
    another), and the greedy continuation after a load is the one after the save; a shared-mode state is refused
    with a ValueError and leaves the Llama usable."""
    r = run_probe("per_head_state", {"policy": policy}, patched=True)
    assert r["tokens_evicted"] > 300 and r["n_distinct_sets"] > 1
    assert r["positions_restored"] and r["positions_in_other"]
    assert r["again"] == r["first"] and r["from_other"] == r["first"]
    assert r["refused"] and "saved in shared mode" in r["refused"]
    assert r["other_still_works"]


def test_per_head_word_eviction():
    """kv_evict_unit="word" per head: every head stays within the budget and keeps its own tokens, and
    save_state/load_state carries the words with each head's positions."""
    r = run_probe("engine_per_head", {"policy": str(KVP_FILE), "evict_unit": "word"}, patched=True)
    assert r["counts"] == [r["cells_used"]] and r["cells_used"] <= 256 and r["tokens_evicted"] > 500
    assert r["n_distinct_sets"] > 1
    state = run_probe("per_head_state", {"policy": "kvp", "evict_unit": "word"}, patched=True)
    assert state["positions_restored"] and state["positions_in_other"]
    assert state["again"] == state["first"] and state["from_other"] == state["first"]


GEMMA_SHIPPED = pathlib.Path(__file__).resolve().parents[1] / "models" / "gemma-3-270m.kvp.bin"


def test_gemma_per_head_without_eviction_is_stock():
    """Gemma 3's sliding-window cache beside a per-head full-attention cache: with the budget above the tokens,
    kv_mode="per_head" gives stock llama-cpp-python's greedy text."""
    args = {"budget": 1024, "n_prompt": 700}
    stock = run_probe("gemma", args, patched=False)
    per = run_probe("gemma", dict(args, policy=str(GEMMA_SHIPPED)), patched=True)
    assert per["tokens_evicted"] == 0 and per["n_distinct_sets"] == 1
    assert per["text"] == stock["text"] and per["text"].strip()


@pytest.mark.parametrize("policy", [str(GEMMA_SHIPPED), "knorm"], ids=["kvp", "knorm"])
def test_gemma_per_head_evicts_the_global_layers_each_by_its_own_scores(policy):
    """Per-head mode on Gemma 3 holds the three global-attention layers (5, 11, 17) per head, each ranking by its
    own column (the shipped policy scores exactly those; knorm scores all 18 layers, and the engine picks the
    three): every head within the budget, the heads keep different tokens, every one the whole sliding window.
    A seq_rm the heads cannot do is refused and leaves the sliding-window cache as it was."""
    r = run_probe("gemma", {"budget": 640, "n_prompt": 1600, "policy": policy, "consensus": 0.0}, patched=True)
    assert r["layers"] == [5, 11, 17] and r["n_head_kv"] == 1
    assert r["tokens_evicted"] >= 1600 - 640 and r["counts"] == [r["cells_used"]] * 3 and r["cells_used"] <= 640
    assert r["n_distinct_sets"] == 3
    assert r["window_held"] and r["n_seen"] > 1600
    assert r["text"].strip()
    assert r["seq_rm_refused"] and r["window_oldest_after"] == r["window_oldest"] < r["cut"]
    assert r["counts_after_refusal"] == r["counts"]


def test_gemma_shared_mode_unchanged_on_the_patched_library():
    """The shared engine on Gemma gives the same text and evictions on the patched library as on the stock one."""
    args = {"budget": 640, "n_prompt": 1200, "policy": str(GEMMA_SHIPPED), "kv_mode": "shared"}
    stock, patched = run_probe("gemma", args, patched=False), run_probe("gemma", args, patched=True)
    assert not stock["patched"] and patched["patched"]
    assert (patched["text"], patched["tokens_evicted"]) == (stock["text"], stock["tokens_evicted"])


def test_unsupported_context_is_refused():
    r = run_probe("refused", patched=True)
    assert r["error"] and "cannot hold per-head state" in r["error"]


def test_kv_buffer_bytes_equal_shared_mode():
    """llama.cpp's own KV buffer report is the same for a per-head and a shared context of the same budget."""
    shared = run_probe("kv_bytes", {"n_ctx": 512}, patched=True)
    per = run_probe("kv_bytes", {"n_ctx": 512, "per_head": True}, patched=True)
    stock = run_probe("kv_bytes", {"n_ctx": 512}, patched=False)
    assert per["enabled"] and not shared["enabled"]
    assert per["lines"] and per["lines"] == shared["lines"] == stock["lines"]
    assert per["n_cells"] == shared["n_cells"] == 512


def test_loader_selects_and_explains(tmp_path):
    patched = run_probe("loader", patched=True)
    assert patched["patched"] and patched["require"] is None
    assert patched["env"] == str(_llama_lib.lib_dir())
    # one copy of each library, all from the patched build (kvp-cpp's extension binds to them by SONAME)
    names = [os.path.basename(p).split(".so")[0] for p in patched["mapped"]]
    assert {"libllama", "libggml", "libggml-base", "libggml-cpu"} <= set(names)
    assert len(names) == len(set(names)), patched["mapped"]
    assert {os.path.dirname(p) for p in patched["mapped"]} == {os.path.realpath(_llama_lib.lib_dir())}
    stock = run_probe("loader", patched=False)
    assert not stock["patched"] and "KVP_CPP_LLAMA=per_head" in stock["require"]
    # llama_cpp imported before kvp_cpp: the stock library is in, and per-head mode says why it cannot be had
    env = _llama_lib.child_environment(True)
    code = ("import llama_cpp, kvp_cpp\nfrom kvp_cpp import per_head\n"
            "try:\n    per_head.enable(0)\nexcept RuntimeError as e:\n    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "imported before kvp_cpp" in out.stdout
    # asked for, but not built (an empty cache): a warning at import, and an error naming the build command
    code = "import kvp_cpp\nfrom kvp_cpp import per_head\ntry:\n    per_head.enable(0)\nexcept RuntimeError as e:\n    print('ERR', e)\n"
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, KVP_CPP_CACHE=str(tmp_path)),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "not built" in out.stderr and _llama_lib.BUILD_COMMAND in out.stderr
    assert "ERR" in out.stdout and _llama_lib.BUILD_COMMAND in out.stdout


# ------------------------------------------------------------------------------------------------ kvp-bench


BENCH_BUDGETS = (64, 1024)  # 1024 holds every prompt: nothing is evicted


def launch_bench(*args: str) -> subprocess.CompletedProcess:
    """kvp-bench through its launcher, which starts the binary on the patched library for --kv-modes per_head."""
    result = subprocess.run([sys.executable, "-m", "kvp_cpp.bench", *args], capture_output=True, text=True,
                            timeout=600, env=_llama_lib.child_environment(False))
    if result.returncode != 0:
        raise AssertionError(f"kvp-bench failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result


def bench_records(json_path) -> list:
    with open(str(json_path)[: -len(".json")] + ".samples.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def bench_tasks(tmp_path_factory, model_path):
    from kvp_cpp.ruler import LlamaTokenizer, generate

    path = tmp_path_factory.mktemp("tasks") / "niah.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for record in generate("niah_single_1", 384, 2, LlamaTokenizer(model_path)):
            f.write(json.dumps(record) + "\n")
    return path


def test_bench_compares_shared_and_per_head_side_by_side(tmp_path, model_path, bench_tasks):
    """kvp-bench --kv-modes shared,per_head: per-head results next to shared ones in one run; the shared results
    are those of a run on the stock library, a per-head result is the one it gives alone, each per-head cache is
    compressed to the budget, and one that holds the prompt evicts nothing."""
    common = ["-m", model_path, "--tasks", str(bench_tasks), "--budgets", ",".join(map(str, BENCH_BUDGETS)),
              "--max-new-tokens", "8", "--variants", "question_included", "-t", "2"]
    both = tmp_path / "both.json"
    result = launch_bench(*common, "--policies", "kvp,keydiff,streaming,full", "--kv-modes", "shared,per_head",
                          "-o", str(both))
    assert "streaming runs shared only: one score per token" in result.stderr
    stock = tmp_path / "stock.json"
    launch_bench(*common, "--policies", "kvp,keydiff,streaming,full", "-o", str(stock))
    alone = tmp_path / "alone.json"
    launch_bench(*common, "--samples", "1", "--policies", "kvp", "--budgets", str(min(BENCH_BUDGETS)),
                 "--kv-modes", "per_head", "-o", str(alone))

    key = lambda r: (r["task"], r["index"], r["policy"], r["budget"], r["kv_mode"])  # noqa: E731
    records = {key(r): r for r in bench_records(both)}
    assert len(records) == 2 * ((2 * 2 + 1) * len(BENCH_BUDGETS) + 1)  # streaming: shared only
    assert {r["kv_mode"] for r in records.values()} == {"shared", "per_head"}
    fields = ("prediction", "score", "llama_cells", "tokens_evicted", "compressed_cells", "cells_max", "kept_digest")
    for r in bench_records(stock):  # shared results: unchanged by the patched library and the per-head jobs
        assert [records[key(r)][f] for f in fields] == [r[f] for f in fields], key(r)
    for r in bench_records(alone):
        assert [records[key(r)][f] for f in fields] == [r[f] for f in fields], key(r)
        assert r["head_consensus"] == 0.9  # the default, recorded and part of the resume key
    assert all("head_consensus" not in r for r in bench_records(stock))
    # The same -o with another consensus computes its own result instead of resuming the default's; rerun, it resumes
    n_alone = len(bench_records(alone))
    for computed in (n_alone, 0):
        launch_bench(*common, "--samples", "1", "--policies", "kvp", "--budgets", str(min(BENCH_BUDGETS)),
                     "--kv-modes", "per_head", "--head-consensus", "0", "-o", str(alone))
        run = json.loads(alone.read_text())["run"]
        assert (run["results_computed"], run["results_resumed"]) == (computed, n_alone - computed)
    assert sorted(r["head_consensus"] for r in bench_records(alone)) == [0.0] * n_alone + [0.9] * n_alone
    assert json.loads(alone.read_text())["config"]["head_consensus"] == 0.0

    for k, r in records.items():
        if r["kv_mode"] != "per_head":
            continue
        shared = records[k[:-1] + ("shared",)]
        assert r["compressed_cells"] == min(r["budget"], r["context_tokens"])
        assert r["cells_max"] == r["compressed_cells"] + r["decoded_tokens"]
        if r["budget"] >= r["context_tokens"]:
            full = records[(k[0], k[1], "full", None, "shared")]
            assert r["tokens_evicted"] == 0 and r["prediction"] == full["prediction"]
        elif r["policy"].startswith("kvp:"):
            assert r["kept_digest"] != shared["kept_digest"]  # the heads kept different tokens

    document = json.loads(both.read_text())
    assert document["config"]["kv_modes"] == ["shared", "per_head"]
    assert {(row["policy"].split(":")[0], row["kv_mode"]) for row in document["results"]} == {
        ("kvp", "shared"), ("kvp", "per_head"), ("keydiff", "shared"), ("keydiff", "per_head"), ("streaming", "shared"),
        ("full", "shared")}
    table = [[cell.strip() for cell in line.strip("|").split("|")] for line in result.stdout.splitlines()]
    assert table[0][:4] == ["variant", "policy", "kv mode", "budget"]
    assert {line[2] for line in table[2:]} == {"shared", "per_head"}


def test_bench_speed_reports_per_head_against_shared(tmp_path, model_path):
    out = tmp_path / "speed.json"
    result = launch_bench("-m", model_path, "--speed", "--contexts", "160", "--policies", "keydiff,full",
                          "--budgets", "64", "--decode-tokens", "4", "--kv-modes", "shared,per_head", "-t", "2",
                          "-o", str(out))
    rows = json.loads(out.read_text())["speed"]
    assert [(r["policy"], r["kv_mode"]) for r in rows] == [
        ("full", "shared"), ("keydiff", "shared"), ("keydiff", "per_head")]
    shared, per_head = rows[1], rows[2]
    assert per_head["prefill_vs_shared"] == pytest.approx(
        per_head["prefill_tokens_per_second"] / shared["prefill_tokens_per_second"])
    assert per_head["decode_vs_shared"] == pytest.approx(shared["decode_ms_per_token"] / per_head["decode_ms_per_token"])
    assert shared["prefill_vs_shared"] == 0
    assert per_head["kv_bytes"] == shared["kv_bytes"] and per_head["cells_max"] <= 64
    assert per_head["tokens_evicted"] >= 160 + 4 - 64
    header = [cell.strip() for cell in result.stdout.splitlines()[0].strip("|").split("|")]
    assert header[:2] == ["policy", "kv mode"] and "prefill vs shared" in header and "decode vs shared" in header


# ------------------------------------------------------------------------- in-graph scoring (llama_kvp_scorer_*)


def _random_policy_file(tmp_path, name, **kwargs):
    from kvp_cpp import policy_file

    path = tmp_path / f"{name}.kvp.bin"
    policy_file.write_policy(path, policy_file.random_policy(**policy_file.smollm2_identity(), **kwargs))
    return str(path)


GRAPH_CASES = {
    # Random policies, with a cache that holds the whole prompt: every token's K and V are the same on both paths,
    # so every score must be. (Once caches differ, later tokens' K and V differ too: a near-tie that the two
    # summation orders break differently changes what a layer attends to.)
    "f16_gelu_sincos": (lambda tmp: _random_policy_file(
        tmp, "f16", hidden=(16, 8), activation="gelu_tanh", weight_dtype="f16", seed=3,
        pos=[(2, 0.01), (3, 0.003), (1, 9.0)]), {"budget": 1024}, 1e-3),
    "f16_gelu_sincos_per_head": (lambda tmp: _random_policy_file(
        tmp, "f16", hidden=(16, 8), activation="gelu_tanh", weight_dtype="f16", seed=3,
        pos=[(2, 0.01), (3, 0.003), (1, 9.0)]), {"budget": 1024, "kv_mode": "per_head"}, 1e-3),
    "silu_half_layers_no_pos": (lambda tmp: _random_policy_file(
        tmp, "silu", hidden=(8,), activation="silu", seed=4, pos=[],
        layer_scored=[l % 2 == 0 for l in range(30)]), {"budget": 1024}, 1e-5),
    "tanh": (lambda tmp: _random_policy_file(tmp, "tanh", hidden=(12,), activation="tanh", seed=5),
             {"budget": 1024}, 1e-5),
    # The shipped policy under eviction: compact positions that shift down every ~60 tokens (the features use the
    # position offset), and per-head eviction; the same scores, evictions and text.
    "shipped_compact": (lambda tmp: str(KVP_FILE), {"compact_limit": 300}, 1e-5),
    "shipped_per_head": (lambda tmp: str(KVP_FILE), {"kv_mode": "per_head"}, 1e-5),
}


@pytest.mark.parametrize("case", list(GRAPH_CASES))
def test_in_graph_scores_equal_the_callback_path(tmp_path, case):
    """kv_scoring="graph" (the policy's MLP as ggml operations inside llama.cpp's decode graph, read back once per
    ubatch, no eval callback) against kv_scoring="callback" (K/V copied out by the callback, scored by the C++
    scorer): the same score for every (token, layer, head) to 1e-5 relative (1e-3 for f16 weights)."""
    make_policy, args, tolerance = GRAPH_CASES[case]
    runs = run_probe("graph_scores", dict(args, policy=make_policy(tmp_path)), patched=True)
    callback, graph = runs["callback"], runs["graph"]
    assert (callback["in_graph"], callback["callback"]) == (False, True)
    assert (graph["in_graph"], graph["callback"]) == (True, False)
    if args.get("budget", 256) == 256:
        assert callback["tokens_evicted"] > 300
    else:
        assert callback["tokens_evicted"] == 0 and len(callback["logical"]) > 700
    if "compact_limit" in args:
        assert callback["compactions"] > 0
    assert graph["logical"] == callback["logical"]
    expected, got = np.array(callback["scores"]), np.array(graph["scores"])
    assert expected.shape == got.shape and expected.shape[1] >= 45
    assert np.abs(expected).max() > 0.1
    np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance * np.abs(expected).max())
    assert (graph["text"], graph["tokens_evicted"], graph["compactions"]) == (
        callback["text"], callback["tokens_evicted"], callback["compactions"])


def test_scoring_path_choice_and_errors():
    """kv_scoring="auto" runs a learned policy in the graph on the patched library with a GPU backend, else through
    the callback (faster on a CPU); "graph" explains what is missing on the stock library and refuses heuristics;
    bad names are named."""
    stock = run_probe("scoring_choice", patched=False)
    assert stock["auto_kvp"] == {"in_graph": False, "callback": True}
    assert stock["graph_kvp"].startswith("RuntimeError") and "KVP_CPP_LLAMA=per_head" in stock["graph_kvp"]
    assert stock["bogus"].startswith("ValueError") and "kv_scoring" in stock["bogus"]
    patched = run_probe("scoring_choice", patched=True)
    assert patched["auto_kvp"] == {"in_graph": patched["gpu"], "callback": not patched["gpu"]}
    assert patched["graph_kvp"] == {"in_graph": True, "callback": False}
    assert patched["callback_kvp"] == {"in_graph": False, "callback": True}
    assert patched["graph_keydiff"].startswith("ValueError") and "'keydiff' is not one" in patched["graph_keydiff"]


def test_scorer_api_refuses_bad_arguments_and_scores_only_set_layers():
    r = run_probe("scorer_api", patched=True)
    assert r["set_before_init"] == -2  # LLAMA_KVP_ERR_NOT_ENABLED
    assert r["bad_width"] == r["bad_last"] == r["bad_activation"] == r["bad_kind"] == -3  # LLAMA_KVP_ERR_ARG
    assert r["ok"] == 0 and r["bad_layer"] == -3 and r["set_layer_3"] == 0
    assert r["n_scored"] == r["n_tokens"]
    scores = np.array(r["layer_3"])
    assert scores.shape == (r["n_tokens"], 3) and np.isfinite(scores).all() and np.ptp(scores) > 0
    assert r["layer_4_is_null"] and r["freed_is_null"]


def test_bench_scoring_paths_agree(tmp_path, model_path, bench_tasks):
    """kvp-bench --scoring graph (the patched library, which the launcher loads) gives the results of --scoring
    callback (the stock library) for the shipped policy."""
    common = ["-m", model_path, "--tasks", str(bench_tasks), "--budgets", ",".join(map(str, BENCH_BUDGETS)),
              "--max-new-tokens", "8", "--variants", "question_included", "--policies", "kvp", "-t", "2"]
    runs = {}
    for scoring in ("callback", "graph"):
        out = tmp_path / f"{scoring}.json"
        launch_bench(*common, "--scoring", scoring, "-o", str(out))
        assert json.loads(out.read_text())["config"]["scoring"] == scoring
        runs[scoring] = {(r["task"], r["index"], r["budget"]): (r["prediction"], r["kept_digest"])
                         for r in bench_records(out)}
    assert runs["graph"] == runs["callback"] and len(runs["graph"]) >= len(BENCH_BUDGETS)


@pytest.mark.parametrize("span_gap", [None, "0", "65536"], ids=["in_place", "staged_rows", "staged_spans"])
def test_llama_cpp_style_test_kvp(tmp_path, model_path, span_gap):
    """The patch series' own llama.cpp test (tests/test-kvp.cpp of patch 0004, kept beside the built libraries),
    compiled against them and run on the default model: bit-identity without eviction, uniform eviction against
    seq_rm, each head's positions and K/V rows after per-head eviction in one and two rounds, and the error codes,
    with flash attention on and off and with f16 and f32 K/V. With `span_gap` the CPU cache moves its rows the way a
    GPU cache does (patch 0006: byte ranges merged into spans, each read and written back once with
    ggml_backend_tensor_get/set): 0 keeps every row its own span, 65536 is the GPU default (one span per tensor here)."""
    lib = _llama_lib.lib_dir()
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler ({compiler}) to build llama.cpp's test-kvp")
    exe = tmp_path / "test-kvp"
    subprocess.run([compiler, "-std=c++17", "-O1", f"-I{lib / 'include'}", str(lib / _llama_lib.LLAMA_TEST_SOURCE),
                    f"-L{lib}", "-lllama", "-lggml", "-lggml-base", f"-Wl,-rpath,{lib}", "-o", str(exe)],
                   check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_KVP_STAGED_SPAN_GAP"}
    if span_gap is not None:
        env["LLAMA_KVP_STAGED_SPAN_GAP"] = span_gap
    out = subprocess.run([str(exe), "-m", str(model_path)], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    assert "test-kvp: OK (0 failed checks)" in out.stdout
    assert out.stdout.count("uniform eviction vs seq_rm: max |logit diff| = 0\n") == 3  # FA on/off, f16 and f32


GPU_CHECKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"


def test_gpu_check_programs_run_on_the_cpu(tmp_path, model_path):
    """The GPU checks of benchmarks/gpu (graph_scoring_check, per_head_check) compiled against the patched library and
    run on the CPU with small sizes, so that what the device runs builds and works: the in-graph scores match the
    double-precision MLP, and the bounded per-head and shared runs both complete every step."""
    lib = _llama_lib.lib_dir()
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler ({compiler}) to build the GPU checks")
    runs = {
        "graph_scoring_check": ["--prompt", "64", "--decode", "2", "--repeats", "1"],
        "per_head_check": ["--budget", "96", "--chunks", "1,8", "--steps", "2", "--repeats", "1"],
    }
    results = {}
    for name, args in runs.items():
        exe = tmp_path / name
        subprocess.run([compiler, "-std=c++17", "-O1", f"-I{lib / 'include'}", str(GPU_CHECKS / f"{name}.cpp"),
                        f"-L{lib}", "-lllama", "-lggml", "-lggml-base", f"-Wl,-rpath,{lib}", "-o", str(exe)],
                       check=True, timeout=300)
        out_json = tmp_path / f"{name}.json"
        out = subprocess.run([str(exe), "-m", str(model_path), "-ngl", "0", "-t", "2", "-o", str(out_json), *args],
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout + out.stderr[-4000:]
        results[name] = json.loads(out_json.read_text())
    scoring = results["graph_scoring_check"]
    assert scoring["correctness"]["ok"] and scoring["correctness"]["scores"] == 64 * 30 * 3
    assert scoring["correctness"]["relative"] < 1e-4
    assert [row["mode"] for row in scoring["speed"]] == ["none", "graph", "callback"]
    per_head = results["per_head_check"]
    assert [row["tokens_per_step"] for row in per_head["rows"]] == [1, 8]
    for row in per_head["rows"]:  # timings only exist here; their values are the device run's business
        assert row["per_head_evict_ms"] > 0 and row["shared_decode_ms"] > 0
        assert math.isfinite(row["per_head_step_over_shared"]) and row["per_head_step_over_shared"] > 0
