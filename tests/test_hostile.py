"""Hostile and wrong inputs to kvp_cpp.Llama, and its limits: every bad input is a clear Python exception after
which the process still works; a policy file can change on disk under a live context; threads; bounded memory.

Field-level rejection by the two kvp.bin readers is tested in test_policy_file.py; here the same defects travel the
whole path a user takes (kvp_cpp.Llama(model, kv_policy=path)).
"""
from __future__ import annotations

import copy
import itertools
import json
import os
import re
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import pytest

import kvp_cpp
from kvp_cpp import _core
from kvp_cpp import policy_file as pf

from conftest import cached_positions
from test_policy_file import HEADER, put, put_field, refresh

TESTS_DIR = Path(__file__).resolve().parent
FUZZ_REGRESSIONS = TESTS_DIR / "data" / "fuzz_regressions"

PROMPT = "The sky is"
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
LLAMA_DEFAULTS = dict(n_ctx=128, n_threads=1, n_threads_batch=1, verbose=False)
LIVE_BUDGET = 64


def smollm2_policy(seed: int = 1, **overrides) -> pf.PolicyData:
    """A small learned policy for the default model (hidden width 4: a ~280 KB file)."""
    return pf.random_policy(**{**pf.smollm2_identity(), **overrides}, hidden=(4,), seed=seed)


SMOLLM2_BLOB = pf.encode_policy(smollm2_policy())


def complete(llm, prompt: str = PROMPT, max_tokens: int = 8) -> str:
    return llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0)["choices"][0]["text"]


def noise_tokens(llm, n: int) -> list:
    unit = llm.tokenize(NOISE.encode(), add_bos=False)
    return (llm.tokenize(b"Remember this.", add_bos=True) + unit * (n // len(unit) + 1))[:n]


def greedy_tokens(llm, prompt_tokens: list, n: int) -> list:
    llm.reset()
    return list(itertools.islice(llm.generate(prompt_tokens, temp=0.0), n))


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def assert_cache_consistent(llm, budget: int) -> None:
    """llama.cpp's cells, the ledger and kv_stats agree, and stay within the budget."""
    positions = cached_positions(llm)
    assert len(positions) <= budget
    assert llm.kv_stats()["cells_used"] == len(positions)
    assert sorted(positions.tolist()) == sorted(llm.kv_engine.ledger()["cache_pos"].tolist())


@dataclass
class Env:
    """What a hostile case acts on. `live` is a learned-policy Llama that has already evicted (None in a subprocess)."""

    model_path: str
    tmp_path: Path
    live: Optional[Any] = None

    def llama(self, **kwargs):
        return kvp_cpp.Llama(self.model_path, **{**LLAMA_DEFAULTS, **kwargs})

    def policy_file(self, blob: bytes) -> str:
        path = self.tmp_path / "hostile.kvp.bin"
        path.write_bytes(blob)
        return str(path)

    def closed_llama(self):
        llm = self.llama(kv_policy=self.policy_file(SMOLLM2_BLOB), kv_budget=LIVE_BUDGET)
        llm.eval(noise_tokens(llm, 3 * LIVE_BUDGET))
        llm.close()
        return llm


@dataclass(frozen=True)
class Case:
    id: str
    act: Callable[[Env], Any]  # does the hostile thing; must raise `error`
    error: type
    match: str  # regular expression the message must contain
    isolated: bool = False  # run in a fresh interpreter, where a crash cannot take pytest down


# --- the cases ------------------------------------------------------------------------------------------------------


def header_field(name: str, value: int) -> Callable[[Env], Any]:
    # file_bytes is checked before the checksum; re-stamping it would undo the change
    blob = put_field(SMOLLM2_BLOB, name, value, fix_crc=name != "file_bytes")
    return lambda env: env.llama(kv_policy=env.policy_file(blob))


def raw_header(offset: int, raw: bytes) -> Callable[[Env], Any]:
    blob = put(SMOLLM2_BLOB, offset, f"{len(raw)}s", raw)
    return lambda env: env.llama(kv_policy=env.policy_file(blob))


# One value outside the spec's range for every header field (docs/kvp-bin-format.md, "Layout").
HEADER_OUT_OF_RANGE = [
    ("version", 3, "version=3 is not supported"),
    ("version", 2, r"n_recency_knots=0 is outside 1..32"),  # a version 2 file without its recency terms
    ("n_recency_knots", 33, "reserved header bytes are not zero"),  # version 1: reserved
    ("header_bytes", 64, "header_bytes=64"),
    ("file_bytes", len(SMOLLM2_BLOB) + 8, f"file_bytes={len(SMOLLM2_BLOB) + 8} but the file is"),
    ("n_layer", 1025, "n_layer=1025 is outside 1..1024"),
    ("n_head_kv", 0, "n_head_kv=0 is outside 1..256"),
    ("head_dim_k", 1025, "head_dim_k=1025 is outside"),
    ("head_dim_v", 0, "head_dim_v=0 is outside"),
    ("n_ctx_train", 0, "n_ctx_train=0 is outside"),
    ("n_pos_features", 17, "n_pos_features=17 is outside 0..16"),
    ("n_dense", 5, "n_dense=5 is outside 1..4"),
    ("hidden[0]", 4097, r"hidden\[0\]=4097 is outside 1..4096"),
    ("hidden[1]", 7, r"hidden\[1\]=7 must be 0 \(n_dense=2\)"),
    ("activation", 4, "activation=4 is outside 0..3"),
    ("weight_dtype", 2, "weight_dtype=2 is outside 0..1"),
    ("metadata_bytes", (16 << 20) + 1, "metadata_bytes=16777217 is more than 16777216"),
    ("reserved", 1, "reserved header bytes are not zero"),
    # In range for the format, impossible for the engine: the file's protected counts are the defaults.
    ("n_sink", 0xFFFFFFFF, r"kv_budget 128 must be at least kv_sink \+ kv_recent \+ 1 = 4294967312\b"),
    ("n_recent", 0, "kv_recent must be >= 1"),
]


def lying_sizes(env: Env):
    """Every size field at its maximum: 2**18 agents of 168 MB each claimed by a file of 4 KiB."""
    header = SMOLLM2_BLOB
    for name, value in {"n_layer": 1024, "n_head_kv": 256, "head_dim_k": 1024, "head_dim_v": 1024, "n_pos_features": 0,
                        "n_dense": 4, "hidden[0]": 4096, "hidden[1]": 4096, "hidden[2]": 4096,
                        "metadata_bytes": 2}.items():  # fmt: skip
        header = put_field(header, name, value)
    blob = refresh(header[:HEADER] + struct.pack("<I", 1) * 1024 + b"{}" + bytes(4))
    return env.llama(kv_policy=env.policy_file(blob))


def sparse_file_of_gigabytes(env: Env):
    """A real 3 GiB (sparse) file: refused from its size, before anything is read or allocated."""
    path = env.tmp_path / "huge.kvp.bin"
    with open(path, "wb") as f:
        f.write(SMOLLM2_BLOB[:HEADER])
        f.truncate(3 << 30)
    before = rss_bytes()
    try:
        env.llama(kv_policy=str(path))
    finally:
        assert rss_bytes() - before < 256 << 20


def policy_for(**identity) -> Callable[[Env], Any]:
    return lambda env: env.llama(kv_policy=env.policy_file(pf.encode_policy(smollm2_policy(**identity))))


def policy_with_protection(n_sink: int, n_recent: int) -> Callable[[Env], Any]:
    data = smollm2_policy()
    data.n_sink, data.n_recent = n_sink, n_recent
    return lambda env: env.llama(kv_policy=env.policy_file(pf.encode_policy(data)))


def with_budget(**kwargs) -> Callable[[Env], Any]:
    return lambda env: env.llama(kv_policy="streaming", **kwargs)


def load_state_with(mutate: Callable[[Any, Env], Any]) -> Callable[[Env], Any]:
    def act(env: Env):
        state = env.live.save_state()
        mutate(state, env)
        env.live.load_state(state)

    return act


def truncate_engine_state(state, env):
    state.kv_engine_state = state.kv_engine_state[:-3]


def zero_llama_state(state, env):
    state.llama_state = bytes(len(state.llama_state))


def engine_state_of_another_policy(state, env):
    other = env.llama(kv_policy="streaming", kv_budget=LIVE_BUDGET)
    other.eval(noise_tokens(other, 40))
    state.kv_engine_state = other.save_state().kv_engine_state


CASES = [
    # every header field out of its range
    *[Case(f"header-{name}={value}", header_field(name, value), ValueError, match)
      for name, value, match in HEADER_OUT_OF_RANGE],  # fmt: skip
    Case("header-magic", raw_header(0, b"KVPOLICX"), ValueError, "bad magic"),
    Case("header-arch-no-nul", raw_header(24, b"x" * 32), ValueError, "arch has no NUL terminator"),
    # headers claiming gigabytes
    Case("claims-terabytes-of-agents", lying_sizes, ValueError,
         r"file_bytes=4230 but the sections require \d{14} bytes"),  # fmt: skip
    Case("file-bytes-2**63", header_field("file_bytes", 1 << 63), ValueError, "file_bytes=9223372036854775808"),
    Case("real-3GiB-file", sparse_file_of_gigabytes, ValueError, "more than the 2 GiB limit"),
    # a policy trained for another model
    Case("other-arch", policy_for(arch="gemma3"), ValueError, r"\(differing: arch\)$"),
    Case("other-layer-count", policy_for(n_layer=29), ValueError, r"\(differing: n_layer\)$"),
    Case("other-head-count", policy_for(n_head_kv=2), ValueError, r"\(differing: n_head_kv\)$"),
    Case("other-key-dim", policy_for(head_dim_k=32), ValueError, r"\(differing: head_dim_k\)$"),
    Case("other-value-dim", policy_for(head_dim_v=128), ValueError, r"\(differing: head_dim_v\)$"),
    Case("other-train-context", policy_for(n_ctx_train=4096), ValueError, r"\(differing: n_ctx_train\)$"),
    # budgets: negative, zero, huge, not integers
    Case("budget-zero", with_budget(kv_budget=0), ValueError, "kv_budget 0 must be at least"),
    Case("budget-negative", with_budget(kv_budget=-1), ValueError, "kv_budget -1 must be at least"),
    Case("budget-negative-numpy", with_budget(kv_budget=np.int64(-3)), ValueError, "kv_budget -3"),
    Case("budget-over-2**24", with_budget(kv_budget=(1 << 24) + 1), ValueError, "larger than any KV cache"),
    Case("budget-2**64", with_budget(kv_budget=1 << 64), ValueError, "larger than any KV cache"),
    # 2**24 cells of SmolLM2 are 360 GiB: refused before llama.cpp allocates (isolated in case it ever is not)
    Case("budget-2**24-original-positions", with_budget(kv_budget=1 << 24, kv_position_mode="original"), ValueError,
         r"kv_budget 16777216 needs a KV cache of 386547056640 bytes .* than the \d+ bytes .* of physical memory",
         isolated=True),  # fmt: skip
    Case("budget-bool", with_budget(kv_budget=True), ValueError, "kv_budget must be an integer"),
    Case("budget-str", with_budget(kv_budget="512"), ValueError, "kv_budget must be an integer"),
    Case("budget-inf", with_budget(kv_budget=float("inf")), ValueError, "kv_budget must be an integer"),
    # the random policy's seed: an unsigned 64-bit integer
    Case("seed-negative", lambda env: env.llama(kv_policy="random", kv_seed=-1), ValueError,
         r"kv_seed must be an integer in \[0, 2\*\*64\), got -1$"),  # fmt: skip
    Case("seed-negative-numpy", lambda env: env.llama(kv_policy="random", kv_seed=np.int64(-7)), ValueError,
         "kv_seed must be an integer"),  # fmt: skip
    Case("seed-2**64", lambda env: env.llama(kv_policy="random", kv_seed=1 << 64), ValueError,
         "got 18446744073709551616$"),  # fmt: skip
    Case("seed-float", lambda env: env.llama(kv_policy="random", kv_seed=1.5), ValueError, "got 1.5$"),
    Case("seed-str", lambda env: env.llama(kv_policy="random", kv_seed="7"), ValueError, "got '7'$"),
    Case("compress-to-zero", lambda env: env.live.kv_compress(0), ValueError, "cannot compress to 0 cells"),
    Case("compress-negative", lambda env: env.live.kv_compress(-1), ValueError, "cannot compress to -1 cells"),
    Case("compress-beyond-context", lambda env: env.live.kv_compress(1 << 40), ValueError, "the context has 256"),
    Case("compress-2**70", lambda env: env.live.kv_compress(1 << 70), ValueError, "compress"),
    # protected tokens that fill the budget
    Case("sink+recent=budget", with_budget(kv_budget=20, kv_sink=10, kv_recent=10), ValueError,
         r"kv_budget 20 must be at least kv_sink \+ kv_recent \+ 1 = 21"),  # fmt: skip
    Case("recent=budget", with_budget(kv_budget=64, kv_sink=0, kv_recent=64), ValueError, r"= 65"),
    Case("sink-2**40", with_budget(kv_budget=64, kv_sink=1 << 40), ValueError, "kv_budget 64 must be at least"),
    Case("recent-2**33", with_budget(kv_budget=64, kv_recent=1 << 33), ValueError, "kv_budget 64 must be at least"),
    Case("file-protects-more-than-budget", policy_with_protection(200, 100), ValueError,
         r"kv_budget 128 must be at least kv_sink \+ kv_recent \+ 1 = 301"),  # fmt: skip
    # odd paths (non-UTF-8 names: test_non_utf8_policy_path)
    Case("path-with-nul", lambda env: env.llama(kv_policy="a\0b.kvp.bin"), ValueError, "not found"),
    Case("path-is-directory", lambda env: env.llama(kv_policy=str(env.tmp_path)), ValueError, "not found"),
    # bad input to a live context
    Case("token-outside-vocabulary", lambda env: env.live.eval([env.live.n_vocab() + 5]), ValueError,
         r"token id 49157 is outside the model's vocabulary \(49152 tokens\)"),  # word-level eviction checks the ids
    Case("state-truncated", load_state_with(truncate_engine_state), ValueError, "kvp ledger image"),
    Case("state-of-another-policy", load_state_with(engine_state_of_another_policy), ValueError, "another policy"),
    Case("state-size-mismatch", load_state_with(lambda state, env: setattr(state, "llama_state_size", 7)), ValueError,
         "llama_state_size is 7 but llama_state holds"),  # fmt: skip
    Case("state-llama-bytes-zeroed", load_state_with(zero_llama_state), RuntimeError, "llama.cpp refused"),
    Case("state-n_tokens-beyond-input_ids", load_state_with(lambda state, env: setattr(state, "n_tokens", 1 << 40)),
         ValueError, r"n_tokens 1099511627776 is outside 0\.\.\d+"),  # fmt: skip
    # kvp methods after close()
    Case("kv_stats-after-close", lambda env: env.closed_llama().kv_stats(), RuntimeError, "closed", isolated=True),
    Case("kv_compress-after-close", lambda env: env.closed_llama().kv_compress(32), RuntimeError, "closed",
         isolated=True),  # fmt: skip
    Case("kv_set_budget-after-close", lambda env: env.closed_llama().kv_set_budget(96), RuntimeError, "closed",
         isolated=True),  # fmt: skip
    Case("eval-after-close", lambda env: env.closed_llama().eval([1, 2, 3]), RuntimeError, "closed", isolated=True),
    Case("generate-after-close", lambda env: next(env.closed_llama().generate([1, 2, 3])), RuntimeError, "closed",
         isolated=True),  # fmt: skip
    Case("reset-after-close", lambda env: env.closed_llama().reset(), RuntimeError, "closed", isolated=True),
    Case("completion-after-close", lambda env: complete(env.closed_llama()), RuntimeError, "closed", isolated=True),
    Case("save_state-after-close", lambda env: env.closed_llama().save_state(), RuntimeError, "closed",
         isolated=True),  # fmt: skip
    Case("load_state-after-close", lambda env: env.closed_llama().load_state(kvp_cpp.KvpLlamaState(
         input_ids=np.zeros(0, np.intc), scores=np.zeros((0, 1), np.single), n_tokens=0, llama_state=b"",
         llama_state_size=0, seed=0, kv_engine_state=b"")), RuntimeError, "closed", isolated=True),  # fmt: skip
]
CASES_BY_ID = {case.id: case for case in CASES}
assert len(CASES_BY_ID) == len(CASES)


def run_isolated_case(case_id: str, model_path: str, tmp_path: str) -> None:
    """Entry point of the subprocess: runs one case, then a normal completion, and reports both as JSON."""
    case = CASES_BY_ID[case_id]
    env = Env(model_path, Path(tmp_path))
    report = {}
    try:
        case.act(env)
        report["raised"] = None
    except Exception as e:  # the parent compares type and message
        report["raised"] = [cls.__name__ for cls in type(e).__mro__]
        report["message"] = str(e)
    report["completion"] = complete(env.llama(kv_policy="streaming"))
    print("RESULT " + json.dumps(report), flush=True)


def run_in_subprocess(function: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    code = (f"import sys; sys.path.insert(0, {str(TESTS_DIR)!r}); import test_hostile; "
            f"test_hostile.{function}(*sys.argv[1:])")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout)


def subprocess_result(result: subprocess.CompletedProcess) -> dict:
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, f"exit code {result.returncode}; stderr ends:\n{result.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


# --- fixtures -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def healthy(model_path):
    """A plain small Llama and its greedy completion of PROMPT: after every case it must still give exactly that."""
    llm = kvp_cpp.Llama(model_path, kv_policy="streaming", **LLAMA_DEFAULTS)
    reference = complete(llm)
    assert len(reference.split()) >= 3
    return llm, reference


@pytest.fixture(scope="module")
def live(model_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("live") / "live.kvp.bin"
    path.write_bytes(SMOLLM2_BLOB)
    llm = kvp_cpp.Llama(model_path, kv_policy=str(path), kv_budget=LIVE_BUDGET, **LLAMA_DEFAULTS)
    llm.eval(noise_tokens(llm, 4 * LIVE_BUDGET))
    return llm


# --- the table ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_hostile_input_is_a_clear_error_and_the_process_goes_on(case, model_path, tmp_path, healthy, live):
    llm, reference = healthy
    if case.isolated:
        report = subprocess_result(run_in_subprocess("run_isolated_case", case.id, model_path, str(tmp_path)))
        assert report["raised"] is not None, "no exception"
        assert case.error.__name__ in report["raised"], report
        assert re.search(case.match, report["message"]), report["message"]
        assert report["completion"] == reference
    else:
        with pytest.raises(case.error, match=case.match):
            case.act(Env(model_path, tmp_path, live))
        # the live context is still coherent and generates within its budget
        assert complete(live, max_tokens=4)
        assert_cache_consistent(live, LIVE_BUDGET)
    assert complete(llm) == reference


# --- non-UTF-8 paths ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("as_type", ["bytes", "str-surrogateescape", "pathlib"])
def test_non_utf8_policy_path_loads_or_is_refused_cleanly(model_path, tmp_path, healthy, as_type):
    raw = os.path.join(os.fsencode(tmp_path), b"policy-\xff\xfe.kvp.bin")  # not UTF-8 in any position
    with open(raw, "wb") as f:
        f.write(SMOLLM2_BLOB)
    path = {"bytes": raw, "str-surrogateescape": os.fsdecode(raw), "pathlib": Path(os.fsdecode(raw))}[as_type]
    env = Env(model_path, tmp_path)
    try:
        llm = env.llama(kv_policy=path, kv_budget=LIVE_BUDGET)
    except ValueError as e:
        assert "path" in str(e) or "policy" in str(e), e
    else:
        llm.eval(noise_tokens(llm, 2 * LIVE_BUDGET))
        assert llm.kv_stats()["tokens_evicted"] > 0 and llm.kv_stats()["policy"] == "kvp"
    llm, reference = healthy
    assert complete(llm) == reference


# --- a valid policy whose scores overflow -------------------------------------------------------------------------


def overflowing_policy() -> pf.PolicyData:
    """Finite weights within the format's rules whose scores overflow f32: most scores are +-inf or NaN."""
    data = smollm2_policy()
    signs = np.random.default_rng(0).choice([-1.0, 1.0], size=(len(data.agents), 4))
    for agent, sign in zip(data.agents.values(), signs):
        agent.weights[0] = agent.weights[0] * np.float32(1e30)
        agent.weights[1] = (sign * 3e38).astype(np.float32).reshape(1, 4)
    return data


@pytest.mark.parametrize("combine", ["sum_softmax", "max_softmax", "mean", "mean_rank"])
def test_policy_with_non_finite_scores_still_evicts_within_budget(model_path, tmp_path, combine):
    env = Env(model_path, tmp_path)
    llm = env.llama(kv_policy=env.policy_file(pf.encode_policy(overflowing_policy())), kv_budget=LIVE_BUDGET,
                    kv_head_combine=combine)  # fmt: skip
    llm.eval(noise_tokens(llm, 6 * LIVE_BUDGET))
    scores = llm.kv_engine.ledger()["scores"]
    assert np.isfinite(scores).mean() < 0.5
    assert_cache_consistent(llm, LIVE_BUDGET)
    logical = llm.kv_engine.ledger()["logical"]
    n = 6 * LIVE_BUDGET
    assert logical[:4].tolist() == [0, 1, 2, 3] and logical[-16:].tolist() == list(range(n - 16, n))
    # Every cached token has a non-finite score in some head (90 columns), so every keep-score is the lowest and the
    # ties go to the older token: exactly the sinks and the newest tokens stay, as under the streaming policy.
    assert not np.isfinite(scores).all(axis=1).any()
    assert logical[4:].tolist() == list(range(n - len(logical) + 4, n))
    assert complete(llm, max_tokens=4)


@pytest.mark.parametrize("combine", kvp_cpp.llama.HEAD_COMBINES)
def test_non_finite_scores_are_the_lowest_keep_score(combine):
    """A token with a NaN or infinite score in any column gets keep-score -inf, and the others are combined as if it
    were absent (tests/cpp/test_core.cpp checks the victims the evictor then picks)."""
    finite = np.array([[3, 0], [5, 2], [1, 1], [0.5, 0]], np.float32)
    nan, inf = np.float32("nan"), np.float32("inf")
    mixed = np.array([[3, 0], [nan, 1], [5, 2], [1, inf], [1, 1], [-inf, -inf], [0.5, 0], [nan, nan]], np.float32)
    keep = _core.combined_keep_scores(mixed, combine)
    assert keep[[1, 3, 5, 7]].tolist() == [-np.inf] * 4
    np.testing.assert_array_equal(keep[[0, 2, 4, 6]], _core.combined_keep_scores(finite, combine))
    assert np.isfinite(keep[[0, 2, 4, 6]]).all()
    assert _core.combined_keep_scores(mixed[[1, 7]], combine).tolist() == [-np.inf, -np.inf]


def test_ranking_view_puts_non_finite_scores_last(tmp_path):
    path = tmp_path / "overflowing.kvp.bin"
    pf.write_policy(path, overflowing_policy())
    rng = np.random.default_rng(0)
    n, identity = 200, pf.smollm2_identity()
    k = rng.standard_normal((n, identity["n_head_kv"], identity["head_dim_k"]), np.float32)
    v = rng.standard_normal((n, identity["n_head_kv"], identity["head_dim_v"]), np.float32)
    view = _core.policy_ranking(str(path), identity, 3, k, v, None, np.arange(n, dtype=np.int64), n_sink=0, n_recent=0)
    for scores, ranking in zip(view["scores"], view["ranking"]):
        finite = np.isfinite(scores[ranking])
        assert 0 < finite.sum() < n
        assert finite[: finite.sum()].all()  # every finite score ranks before every non-finite one
        order = scores[ranking][: finite.sum()]
        assert (np.diff(order) <= 0).all()
        assert (np.diff(ranking[finite.sum() :]) < 0).all()  # the non-finite ones among themselves: newest first


# --- a policy file that changes on disk -----------------------------------------------------------------------------


def overwrite_in_place(path: Path, data: bytes) -> None:
    with open(path, "r+b") as f:  # same inode: what an mmap of the file would see
        f.write(data)
        f.truncate(len(data))


REPLACEMENTS = {
    "garbage-in-place": lambda path: overwrite_in_place(path, bytes(len(SMOLLM2_BLOB))),
    "truncated-in-place": lambda path: overwrite_in_place(path, b""),
    "deleted": lambda path: path.unlink(),
    "other-policy-renamed-over": lambda path: (
        path.with_suffix(".new").write_bytes(pf.encode_policy(smollm2_policy(seed=99))),
        os.replace(path.with_suffix(".new"), path),
    ),
}


@pytest.mark.parametrize("replace", list(REPLACEMENTS))
def test_policy_file_replaced_while_in_use(model_path, tmp_path, replace):
    path = tmp_path / "policy.kvp.bin"
    path.write_bytes(SMOLLM2_BLOB)
    llm = Env(model_path, tmp_path).llama(kv_policy=str(path), kv_budget=LIVE_BUDGET)
    prompt = noise_tokens(llm, 3 * LIVE_BUDGET)
    before = greedy_tokens(llm, prompt, 12)
    scores_before = llm.kv_engine.ledger()["scores"]
    REPLACEMENTS[replace](path)
    assert greedy_tokens(llm, prompt, 12) == before  # the policy was read into memory once
    np.testing.assert_array_equal(llm.kv_engine.ledger()["scores"], scores_before)
    assert_cache_consistent(llm, LIVE_BUDGET)


# --- threads ----------------------------------------------------------------------------------------------------------


def run_in_threads(jobs: list) -> tuple[list, list]:
    """Runs the callables at once (released together by a barrier); returns their results and (start, end) times."""
    results, spans = [None] * len(jobs), [None] * len(jobs)
    barrier = threading.Barrier(len(jobs))

    def run(i):
        barrier.wait()
        start = time.perf_counter()
        try:
            results[i] = jobs[i]()
        except Exception as e:  # reported to the caller
            results[i] = e
        spans[i] = (start, time.perf_counter())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, spans


def test_two_instances_generate_in_two_threads_as_they_do_alone(model_path, tmp_path):
    env = Env(model_path, tmp_path)
    llms = [env.llama(kv_policy=env.policy_file(SMOLLM2_BLOB), kv_budget=64, kv_sink=2, kv_recent=8),
            env.llama(kv_policy="streaming", kv_budget=96, kv_head_combine="mean")]  # fmt: skip
    prompts = [noise_tokens(llms[0], 200), llms[1].tokenize(("Tell me a story. " * 30).encode())]
    alone = [greedy_tokens(llm, prompt, 32) for llm, prompt in zip(llms, prompts)]
    together, spans = run_in_threads([lambda i=i: greedy_tokens(llms[i], prompts[i], 32) for i in range(2)])
    assert together == alone
    assert spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1]  # they did run at the same time
    for llm, budget in zip(llms, (64, 96)):
        assert llm.kv_stats()["tokens_evicted"] > 0
        assert_cache_consistent(llm, budget)


CONCURRENT_USE_REFUSAL = r"thread|in use|concurren"


def run_one_instance_from_two_threads(model_path: str) -> None:
    """Subprocess entry point: one Llama, two threads generating at once; reports what each thread got."""
    llm = kvp_cpp.Llama(model_path, kv_policy="streaming", kv_budget=64, **LLAMA_DEFAULTS)
    prompts = [noise_tokens(llm, 150), llm.tokenize(("Tell me a story. " * 20).encode())]
    alone = [greedy_tokens(llm, prompt, 24) for prompt in prompts]
    together, _ = run_in_threads([lambda i=i: greedy_tokens(llm, prompts[i], 24) for i in range(2)])
    report = [
        {"same": got == expected} if isinstance(got, list) else {"error": type(got).__name__, "message": str(got)}
        for got, expected in zip(together, alone)
    ]
    print("RESULT " + json.dumps(report), flush=True)


def test_one_instance_from_two_threads_is_serialised_or_refused(model_path):
    """Either both threads get their single-threaded output, or one is refused with a clear RuntimeError."""
    report = subprocess_result(run_in_subprocess("run_one_instance_from_two_threads", model_path))
    assert any(thread.get("same") for thread in report), report
    for thread in report:
        if "error" in thread:
            assert thread["error"] == "RuntimeError" and re.search(CONCURRENT_USE_REFUSAL, thread["message"]), report
        else:
            assert thread["same"], report


# --- a refused state changes nothing ----------------------------------------------------------------------------------

# How a saved state is spoiled (attributes to replace), what load_state raises and a pattern of its message.
BAD_STATES = {
    "ledger-truncated": (lambda s: {"kv_engine_state": s.kv_engine_state[:-3]}, ValueError, "kvp ledger image"),
    "ledger-over-budget": (lambda s: {"kv_engine_state": s.kv_engine_state[:8] + bytes(8)}, ValueError, "ledger"),
    "llama-size-mismatch": (lambda s: {"llama_state_size": s.llama_state_size + 1}, ValueError, "llama_state_size"),
    "n_tokens-negative": (lambda s: {"n_tokens": -1}, ValueError, "n_tokens -1 is outside"),
    "scores-wrong-shape": (lambda s: {"scores": np.zeros((2, 3), np.single)}, ValueError, "saved scores"),
    # llama.cpp reads these and refuses them, possibly after clearing the cache: undone from a copy
    "llama-bytes-zeroed": (lambda s: {"llama_state": bytes(len(s.llama_state))}, RuntimeError, "refused"),
    "llama-bytes-halved": (lambda s: {"llama_state": s.llama_state[: len(s.llama_state) // 2],
                                      "llama_state_size": len(s.llama_state) // 2}, RuntimeError, "refused"),
}  # fmt: skip


def continue_greedily(llm, n: int) -> list:
    """Greedy continuation of the logical history as it stands (generate() reuses the cached prefix)."""
    return list(itertools.islice(llm.generate(llm.input_ids[: llm.n_tokens].tolist(), temp=0.0), n))


def everything_about(llm) -> tuple:
    state = llm.save_state()
    ledger = llm.kv_engine.ledger()
    return (llm.n_tokens, llm.input_ids[: llm.n_tokens].tolist(), state.llama_state, state.kv_engine_state,
            ledger["logical"].tolist(), ledger["cache_pos"].tolist(), sorted(cached_positions(llm).tolist()),
            llm.kv_stats()["cells_used"])  # fmt: skip


@pytest.mark.parametrize("bad", list(BAD_STATES))
def test_refused_load_state_leaves_the_llama_as_it_was(model_path, tmp_path, bad):
    env = Env(model_path, tmp_path)
    llm = env.llama(kv_policy=env.policy_file(SMOLLM2_BLOB), kv_budget=LIVE_BUDGET)
    llm.eval(noise_tokens(llm, 3 * LIVE_BUDGET))
    older = llm.save_state()  # the spoiled state is made from this one: half loading it would show
    llm.eval(llm.tokenize(b" Now for something completely different:", add_bos=False))
    current = llm.save_state()
    change, error, match = BAD_STATES[bad]
    spoiled = copy.copy(older)
    for name, value in change(older).items():
        setattr(spoiled, name, value)
    before = everything_about(llm)

    with pytest.raises(error, match=match):
        llm.load_state(spoiled)
    assert everything_about(llm) == before
    continued = continue_greedily(llm, 12)
    llm.load_state(current)
    assert continue_greedily(llm, 12) == continued
    assert_cache_consistent(llm, LIVE_BUDGET)


# --- a KV cache larger than the machine ---------------------------------------------------------------------------


def test_budget_beyond_physical_memory_is_refused_before_allocation(model_path, tmp_path, monkeypatch):
    env = Env(model_path, tmp_path)
    per_cell = env.llama(kv_policy="streaming", kv_budget=256).kv_stats()["kv_bytes_allocated"] // 256
    memory = 64 << 20
    monkeypatch.setattr(sys.modules["kvp_cpp.llama"], "_physical_memory_bytes", lambda: memory)
    cells = memory // per_cell // 256 * 256 + 256  # the first multiple of 256 cells that does not fit
    before = rss_bytes()
    for budget in (cells, cells - 255):  # llama.cpp would round the second up to the first
        with pytest.raises(ValueError, match=rf"^kv_budget {budget} needs a KV cache of {cells * per_cell} bytes "
                                             rf"\({cells} cells, .* than the {memory} bytes \(0.1 GiB\) of physical"):
            env.llama(kv_policy="streaming", kv_budget=budget)
    assert rss_bytes() - before < 16 << 20
    llm = env.llama(kv_policy="streaming", kv_budget=cells - 256)  # fits
    assert llm.kv_stats()["kv_bytes_allocated"] == (cells - 256) * per_cell <= memory


# --- memory is bounded by the budget, not by the tokens seen ---------------------------------------------------------


def test_memory_is_bounded_by_the_budget(model_path, tmp_path):
    budget, chunk = LIVE_BUDGET, 32
    env = Env(model_path, tmp_path)
    llm = env.llama(kv_policy=env.policy_file(SMOLLM2_BLOB), kv_budget=budget)
    n_columns = llm.kv_engine.ledger()["scores"].shape[1]
    assert llm.kv_engine.eviction_unit == "word"  # the default, whose ledger is the larger one
    # engine image: next logical index, ledger magic and 3-word header, then per entry 3 int64 positions, the word
    # (int64) and token id (int32) of word-level eviction, and a score row
    max_image = 8 + 32 + budget * (3 * 8 + 8 + 4 + 4 * n_columns)
    tokens = noise_tokens(llm, 20 * budget)
    warm_up = 2 * budget

    llm.eval(tokens[:warm_up])
    rss_after_warm_up = rss_bytes()
    state_bytes = llm.kv_stats()["policy_state_bytes"]
    for start in range(warm_up, len(tokens), chunk):
        llm.eval(tokens[start : start + chunk])
        stats = llm.kv_stats()
        assert stats["cells_used"] <= budget
        assert len(llm.kv_engine.save()) <= max_image
        assert stats["policy_state_bytes"] == state_bytes
    for token in tokens[:budget]:  # single-token decode steps too
        llm.eval([token])
    stats = llm.kv_stats()
    assert stats["tokens_seen"] == 21 * budget and stats["tokens_evicted"] >= 20 * budget
    # The soak criterion: RSS grows less than 5% after warm-up (RSS also holds the allocator's and
    # llama.cpp's own buffers; the ledger and policy state are bounded exactly above). Measured before the
    # consistency check, which reads a copy of llama.cpp's whole state (about 14 MB) once.
    assert rss_bytes() - rss_after_warm_up < 0.05 * rss_after_warm_up
    assert_cache_consistent(llm, budget)


# --- fuzzer findings ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(FUZZ_REGRESSIONS.glob("*")), ids=lambda path: path.name)
def test_fuzz_regression_is_rejected_by_both_loaders(path):
    """Every input the fuzzer (fuzz/run.sh) ever crashed on is a clean PolicyFormatError in both loaders."""
    with pytest.raises(pf.PolicyFormatError):
        pf.read_policy(path)
    with pytest.raises(_core.PolicyFormatError):
        _core.load_policy(str(path))
