"""The baseline policies: registry, ranking view, planted cases, llama.cpp's own attention, and both protocols."""
import numpy as np
import pytest

import llama_cpp
import kvp_cpp
from kvp_cpp import _core
from kvp_cpp import policy_file as pf

from conftest import cached_positions

ATTENTION_BASED = ["tova", "snapkv", "observed_attention", "h2o"]
KEEPS_KEY_COPIES = ["keydiff", "lagkv"] + ATTENTION_BASED
ALL_POLICIES = ["streaming", "random", "knorm", "keydiff", "lagkv"] + ATTENTION_BASED
IDENTITY = pf.smollm2_identity()  # 30 layers, 3 KV heads of 64; 9 query heads
N_HEAD = 9
F32 = 0  # GGML_TYPE_F32 for type_k/type_v: llama.cpp then computes attention from the keys exactly as captured
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
RECORDED_LAYERS = [0, 29]


def rank(policy, k, q=None, v=None, layer=3, n_sink=0, n_recent=0):
    n = k.shape[0]
    v = np.zeros_like(k) if v is None else v
    return _core.policy_ranking(policy, IDENTITY, layer, k.astype(np.float32), v.astype(np.float32),
                                None if q is None else q.astype(np.float32), np.arange(n, dtype=np.int64),
                                n_sink=n_sink, n_recent=n_recent)


def unit_vector(rng, dim=64):
    u = rng.standard_normal(dim)
    return u / np.linalg.norm(u)


def columns_of_layer(scores, layer):
    """A ledger's score columns for one layer, as (heads, tokens): per KV head, per layer, or one token-level."""
    n_columns = scores.shape[1]
    if n_columns == 1:
        return np.repeat(scores.T, 3, axis=0)
    if n_columns == IDENTITY["n_layer"]:
        return np.repeat(scores[:, layer][None, :], 3, axis=0)
    return scores[:, 3 * layer : 3 * layer + 3].T


def assert_cache_within(llm, budget):
    positions = cached_positions(llm)
    stats = llm.kv_stats()
    assert 0 < len(positions) <= budget
    assert stats["cells_used"] == len(positions)
    assert sorted(positions.tolist()) == sorted(llm.kv_engine.ledger()["cache_pos"].tolist())


def key_copy_bytes(llm, policy):
    """The host copy of the cached keys (and values, for LagKV) a policy must hold: float32, every layer."""
    copies = 2 if policy == "lagkv" else 1 if policy in KEEPS_KEY_COPIES else 0
    return copies * llm.kv_stats()["cells_used"] * IDENTITY["n_layer"] * 3 * 64 * 4


def prompt_tokens(llm, n_tokens):
    return llm.tokenize((NOISE * (n_tokens // 10 + 1)).encode())[:n_tokens]


def decode_one_by_one(llm, n_tokens):
    """Decoding as generation does it, one token per llama_decode (which tokens does not matter here)."""
    for token in prompt_tokens(llm, n_tokens):
        llm.eval([token])


# --- registry -----------------------------------------------------------------------------------------------------


def test_registry_lists_every_policy():
    assert sorted(kvp_cpp.builtin_policies()) == sorted(ALL_POLICIES)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((80, 3, 64))
    q = rng.standard_normal((8, N_HEAD, 64))
    for policy in ALL_POLICIES:
        result = rank(policy, k, q, v=rng.standard_normal((80, 3, 64)))
        assert result["scores"].shape == (3, 80) and np.isfinite(result["scores"]).all()
        assert all(sorted(row) == list(range(80)) for row in result["ranking"].tolist())


def test_unknown_policy_raises_value_error(model_path):
    with pytest.raises(ValueError, match="unknown kv_policy"):
        kvp_cpp.Llama(model_path, kv_policy="h3o")
    with pytest.raises(ValueError, match="unknown policy 'h3o'"):
        rank("h3o", np.zeros((8, 3, 64)))


def test_attention_policies_need_queries():
    with pytest.raises(ValueError, match="needs the queries"):
        rank("tova", np.zeros((8, 3, 64)))


# --- planted cases through the ranking view -------------------------------------------------------------------------


def test_knorm_keeps_the_planted_low_norm_keys():
    rng = np.random.default_rng(1)
    k = rng.standard_normal((120, 3, 64))
    planted = [10, 47, 90]
    k[planted] *= 0.05
    ranking = rank("knorm", k, n_sink=4, n_recent=16)["ranking"]
    protected = set(range(4)) | set(range(104, 120))
    for row in ranking:
        assert set(row[:20]) == protected
        assert set(row[20:23]) == set(planted)


def test_keydiff_keeps_the_outlier_key():
    rng = np.random.default_rng(2)
    direction = unit_vector(rng)
    k = 5.0 * direction + 0.3 * rng.standard_normal((120, 3, 64))
    k[57] = -5.0 * direction
    for row in rank("keydiff", k)["ranking"]:
        assert row[0] == 57


def test_streaming_ranks_sinks_then_the_most_recent():
    ranking = rank("streaming", np.ones((60, 3, 64)), n_sink=4, n_recent=8)["ranking"]
    for budget in (12, 20, 37):
        kept = set(ranking[0, :budget])
        assert kept == set(range(4)) | set(range(60 - (budget - 4), 60))
    assert (ranking == ranking[0]).all()


def test_streaming_engine_keeps_exactly_sinks_and_the_most_recent(model_path):
    llm = kvp_cpp.Llama(model_path, kv_policy="streaming", kv_budget=48, kv_sink=4, n_ctx=256, n_batch=32,
                        verbose=False)
    llm.eval(prompt_tokens(llm, 150))
    logical = llm.kv_engine.ledger()["logical"].tolist()
    assert_cache_within(llm, 48)
    assert logical == [0, 1, 2, 3] + list(range(150 - (len(logical) - 4), 150))


def test_ties_break_by_recency_then_head():
    n = 10
    result = rank("knorm", np.ones((n, 3, 64)), n_sink=2, n_recent=3)
    expected = [9, 8, 7, 1, 0, 6, 5, 4, 3, 2]  # protected first; among equals, the more recent first
    assert result["ranking"].tolist() == [expected] * 3
    joint = result["joint_ranking"].tolist()
    assert joint == [[head, token] for token in expected for head in range(3)]


@pytest.mark.parametrize("policy", ["tova", "snapkv"])
def test_window_policies_keep_the_key_the_planted_queries_attend_to(policy):
    rng = np.random.default_rng(3)
    target = unit_vector(rng)
    k = 0.1 * rng.standard_normal((128, 3, 64))
    k[41] = 8.0 * target
    q = 8.0 * target + 0.1 * rng.standard_normal((64, N_HEAD, 64))  # the queries of the last 64 tokens
    result = rank(policy, k, q, n_sink=4, n_recent=16)
    # SnapKV ranks its observation window (the queries' own tokens) first, as kvpress pads it, and pooling (kernel 5)
    # spreads the attended key's weight over its neighbours, which it keeps together.
    kept_together = {41} if policy == "tova" else set(range(39, 44))
    for row in result["ranking"]:
        before_window = [token for token in row if 4 <= token < 64]
        assert set(before_window[: len(kept_together)]) == kept_together
    if policy == "tova":
        assert (result["scores"] == result["scores"][0]).all()  # one score per layer, shared by its heads


@pytest.mark.parametrize("policy", ["h2o", "observed_attention"])
def test_accumulating_policies_keep_the_heavy_hitter(policy):
    rng = np.random.default_rng(4)
    target = unit_vector(rng)
    k = 0.1 * rng.standard_normal((128, 3, 64))
    k[23] = 8.0 * target
    q = 0.1 * rng.standard_normal((128, N_HEAD, 64))
    q[23:] += 8.0 * target  # every query that can see token 23 attends to it
    for row in rank(policy, k, q)["ranking"]:
        assert row[0] == 23


def lagkv_reference(k, v, n_sink=4, lag=128):
    """kvpress LagKVPress.score for one layer, (n, heads, dim) -> (heads, n), with kv-cpp's guard: a channel that is
    constant in the reference partition contributes 0."""
    n, heads, _ = k.shape
    scores = np.ones((heads, n))
    if n < n_sink + 2 * lag:
        scores[:, n_sink:] = np.arange(n - n_sink) / (n - n_sink)
        return scores
    end = n_sink + (n - n_sink) // lag * lag

    def partition_scores(x):
        parts = x[n_sink:end].transpose(1, 0, 2).reshape(heads, -1, lag, x.shape[2])
        reference, current = parts[:, 1:], parts[:, :-1]
        low = reference.min(axis=2, keepdims=True)
        spread = reference.max(axis=2, keepdims=True) - low
        normalised = np.where(spread > 0, (current - low) / np.where(spread > 0, spread, 1.0), 0.0)
        raw = normalised.std(axis=-1, ddof=1)
        e = np.exp(raw - raw.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    combined = (partition_scores(k) + partition_scores(v)) / 2
    ranks = combined.argsort(axis=-1, kind="stable").argsort(axis=-1, kind="stable") / lag
    scores[:, n_sink : end - lag] = ranks.reshape(heads, -1)
    return scores


def test_lagkv_matches_the_reference_formula():
    rng = np.random.default_rng(5)
    n = 4 + 4 * 128 + 37  # three scored partitions, then the last full one and a remainder
    k = rng.standard_normal((n, 3, 64)).astype(np.float32)
    v = rng.standard_normal((n, 3, 64)).astype(np.float32)
    k[4 + 2 * 128 : 4 + 3 * 128, 1, 5] = 0.25  # a constant channel in partition 1's reference: max - min = 0
    got = rank("lagkv", k, v=v)["scores"]
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, lagkv_reference(k, v), atol=1e-6)

    short = rank("lagkv", k[:100], v=v[:100])["scores"]
    np.testing.assert_allclose(short, lagkv_reference(k[:100], v[:100]), atol=1e-6)


# --- llama.cpp's own attention --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def recorded(model_path):
    """Qcur/Kcur/Vcur and kq_soft_max of two layers for one 100-token ubatch, flash attention off, f32 cache."""
    llm = llama_cpp.Llama(model_path, n_ctx=256, n_batch=128, n_ubatch=128, flash_attn=False, type_k=F32,
                          type_v=F32, verbose=False)
    recorder = _core.Recorder(names=["kq_soft_max", "Qcur", "Kcur", "Vcur"], layers=RECORDED_LAYERS)
    kvp_cpp.llama.recreate_context(llm, callback_address=recorder.callback_address, user_data=recorder.address)
    tokens = prompt_tokens(llm, 100)
    llm.eval(tokens)
    captures = {(name, layer): array[0] for name, layer, array in recorder.take()}
    llm.close()
    return tokens, captures


def recorded_ranking(recorded, policy, layer, **protection):
    tokens, captures = recorded
    qkv = [np.ascontiguousarray(captures[(name, layer)]) for name in ("Qcur", "Kcur", "Vcur")]
    return _core.policy_ranking(policy, IDENTITY, layer, qkv[1], qkv[2], qkv[0],
                                np.arange(len(tokens), dtype=np.int64), **protection)


def attention_scores(policy, attention):
    """What each attention-based policy computes, from llama.cpp's kq_soft_max (heads, queries, keys); entries the
    policy pads (its own window) are NaN."""
    n_head, n, _ = attention.shape
    group_mean = lambda per_head: per_head.reshape(3, n_head // 3, -1).mean(axis=1)
    if policy == "tova":
        scores = np.repeat(attention[:, -1, :].mean(axis=0)[None, :], 3, axis=0)
        scores[:, -1] = np.nan
    elif policy == "snapkv":
        window = attention[:, -64:, : n - 64].mean(axis=1)
        padded = np.pad(window, ((0, 0), (2, 2)))
        pooled = sum(padded[:, shift : shift + n - 64] for shift in range(5)) / 5
        scores = np.concatenate([group_mean(pooled), np.full((3, 64), np.nan)], axis=1)
    elif policy == "observed_attention":
        scores = group_mean(attention.sum(axis=1) / np.arange(n, 0, -1))
    else:
        scores = group_mean(attention.sum(axis=1))
    return scores


@pytest.mark.parametrize("layer", RECORDED_LAYERS)
@pytest.mark.parametrize("policy", ATTENTION_BASED)
def test_recomputed_attention_equals_llama_cpp(recorded, policy, layer):
    tokens, captures = recorded
    n = len(tokens)
    attention = captures[("kq_soft_max", layer)][:, :, :n].astype(np.float64)  # masked cells are 0
    expected = attention_scores(policy, attention)
    got = recorded_ranking(recorded, policy, layer, n_sink=0, n_recent=0)["scores"]
    padded = np.isnan(expected)
    np.testing.assert_allclose(got[~padded], expected[~padded], rtol=1e-5, atol=1e-4)
    assert (got[padded] == got[~padded].max() + 1).all()


# --- both protocols, end to end ------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_oneshot_protocol(model_path, recorded, policy):
    """Prefill everything, kv_compress once (the policy ranks every cached token from what it saw), then decode
    under the compressed budget. The engine's scores are the ranking view's for the same captured tensors."""
    tokens, _ = recorded
    llm = kvp_cpp.Llama(model_path, kv_policy=policy, kv_budget=256, n_ctx=256, n_batch=128, n_ubatch=128,
                        flash_attn=False, type_k=F32, type_v=F32, verbose=False)
    llm.eval(tokens)
    assert llm.kv_compress(48) == len(tokens) - 48
    ledger = llm.kv_engine.ledger()
    for layer in RECORDED_LAYERS:
        view = recorded_ranking(recorded, policy, layer)["scores"][:, ledger["logical"]]
        np.testing.assert_allclose(columns_of_layer(ledger["scores"], layer), view, rtol=1e-6, atol=1e-7)
    # Copies of evicted tokens are gone, and no queries are held once they were used (indices and sums add < 10%).
    copies = key_copy_bytes(llm, policy)
    assert copies <= llm.kv_stats()["policy_state_bytes"] <= 1.1 * copies
    decode_one_by_one(llm, 8)
    assert_cache_within(llm, 48)
    assert llm.kv_stats()["eviction_rounds"] >= 2


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_bounded_protocol(model_path, policy):
    """The cache is capped from the first token: chunked prefill and decoding evict as they go."""
    llm = kvp_cpp.Llama(model_path, kv_policy=policy, kv_budget=64, n_ctx=256, n_batch=64, verbose=False)
    llm.eval(prompt_tokens(llm, 128))
    assert_cache_within(llm, 64)
    decode_one_by_one(llm, 8)
    assert_cache_within(llm, 64)
    stats = llm.kv_stats()
    assert stats["tokens_seen"] == 136 and stats["tokens_evicted"] >= 136 - 64
    assert stats["policy_state_bytes"] >= key_copy_bytes(llm, policy)
    assert (stats["policy_state_bytes"] == 0) == (policy not in KEEPS_KEY_COPIES)
    llm.reset()
    assert llm.kv_stats()["policy_state_bytes"] == 0
