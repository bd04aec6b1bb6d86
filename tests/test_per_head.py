"""Per-head KV eviction on the patched llama.cpp (kvp_cpp/llama_patches, built by ``python -m kvp_cpp.llama_build``).

Every check runs in a fresh process (tests/per_head_probe.py), because a process loads one libllama for good: the
patched one with ``KVP_CPP_LLAMA=per_head``, llama-cpp-python's own without. Skipped, with the reason, when the
patched library is not built.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from kvp_cpp import _llama_lib

PROBE = pathlib.Path(__file__).with_name("per_head_probe.py")

pytestmark = pytest.mark.skipif(
    not _llama_lib.is_built(),
    reason=f"the patched llama.cpp is not built ({_llama_lib.lib_dir()}); run `{_llama_lib.BUILD_COMMAND}`",
)


def run_probe(scenario: str, args=None, *, patched: bool, timeout: float = 300):
    env = {k: v for k, v in os.environ.items() if k not in ("LLAMA_CPP_LIB_PATH", _llama_lib.ENV_SELECT)}
    if patched:
        env[_llama_lib.ENV_SELECT] = "per_head"
    out = subprocess.run([sys.executable, str(PROBE), scenario, json.dumps(args or {})], env=env,
                         capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise AssertionError(f"probe {scenario} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("flash_attn", [True, False])
def test_patched_library_is_bit_identical_to_stock(flash_attn):
    """llama-cpp-python on the patched library: same greedy tokens and the same logits, bit for bit."""
    args = {"flash_attn": flash_attn, "n_new": 24, "chunk": 64}
    stock = run_probe("greedy", args, patched=False)
    patched = run_probe("greedy", args, patched=True)
    assert not stock["patched"] and patched["patched"]
    assert patched["lib"] == str(_llama_lib.lib_dir())
    assert patched["tokens"] == stock["tokens"]
    assert patched["logits_sha256"] == stock["logits_sha256"]


@pytest.mark.parametrize("flash_attn", [True, False])
def test_per_head_without_eviction_is_bit_identical_to_stock(flash_attn):
    """Per-head mode with the budget above the token count: the stock library's greedy tokens and logits,
    whether enabled before the first token or after some."""
    args = {"flash_attn": flash_attn, "n_new": 24, "chunk": 64}
    stock = run_probe("greedy", args, patched=False)
    for enable_at in (0, 64):
        got = run_probe("greedy", dict(args, enable_at=enable_at), patched=True)
        assert got["per_head_enabled"]
        assert got["tokens"] == stock["tokens"]
        assert got["logits_sha256"] == stock["logits_sha256"]


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


def test_loader_selects_and_explains():
    patched = run_probe("loader", patched=True)
    assert patched["patched"] and patched["require"] is None
    assert patched["env"] == str(_llama_lib.lib_dir())
    stock = run_probe("loader", patched=False)
    assert not stock["patched"] and "KVP_CPP_LLAMA=per_head" in stock["require"]
    # llama_cpp imported before kvp_cpp: the stock library is in, and per-head mode says why it cannot be had
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_LIB_PATH"}
    env[_llama_lib.ENV_SELECT] = "per_head"
    code = ("import llama_cpp, kvp_cpp\nfrom kvp_cpp import per_head\n"
            "try:\n    per_head.enable(0)\nexcept RuntimeError as e:\n    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "imported before kvp_cpp" in out.stdout
