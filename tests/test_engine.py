"""The eviction engine inside llama.cpp, driven through kvp_cpp.Llama on the default model."""
import pickle

import numpy as np
import pytest

import llama_cpp
import kvp_cpp
from kvp_cpp import policy_file as pf

from conftest import cached_positions

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"


@pytest.fixture(scope="module")
def random_policy_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("policies") / "random.kvp.bin"
    pf.write_policy(path, pf.random_policy(**pf.smollm2_identity(), hidden=(16,), seed=3))
    return str(path)


def planted_policy(planted_position: int, **identity) -> pf.PolicyData:
    """Every agent scores 1000 at one original position and 0 elsewhere, from the position feature alone:
    1000 * (relu(p - P + 1) - 2 relu(p - P) + relu(p - P - 1)) is a unit triangle peaked at P."""
    identity = identity or pf.smollm2_identity()
    data = pf.random_policy(**identity, hidden=(3,), pos=[(0, 1.0)], seed=0)
    dim = data.input_dim
    for agent in data.agents.values():
        agent.shift[:] = 0.0
        agent.scale[:] = 1.0
        w1 = np.zeros((3, dim), np.float32)
        w1[:, dim - 1] = 1.0
        agent.weights = [w1, np.array([[1000.0, -2000.0, 1000.0]], np.float32)]
        agent.biases = [np.array([1 - planted_position, -planted_position, -planted_position - 1], np.float32),
                        np.zeros(1, np.float32)]
    return data


def long_prompt(llm, n_tokens: int) -> list:
    unit = llm.tokenize(NOISE.encode(), add_bos=False)
    tokens = llm.tokenize(b"Remember this.", add_bos=True)
    while len(tokens) < n_tokens:
        tokens += unit
    return tokens[:n_tokens]


def assert_within_budget(llm, budget):
    positions = cached_positions(llm)
    stats = llm.kv_stats()
    assert len(positions) <= budget
    assert stats["cells_used"] == len(positions)
    ledger = llm.kv_engine.ledger()
    assert sorted(positions.tolist()) == sorted(ledger["cache_pos"].tolist())
    return positions


# --- no eviction: identical to llama.cpp ------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["streaming", "random", "learned"])
@pytest.mark.parametrize("flash_attn", [False, True])
def test_no_eviction_is_identical_to_llama_cpp(model_path, random_policy_path, policy, flash_attn):
    kv_policy = random_policy_path if policy == "learned" else policy
    common = dict(n_ctx=512, n_batch=64, n_ubatch=64, logits_all=True, verbose=False, flash_attn=flash_attn, seed=1)
    reference = llama_cpp.Llama(model_path, **common)
    ours = kvp_cpp.Llama(model_path, kv_policy=kv_policy, **common)
    tokens = long_prompt(reference, 200)
    reference.eval(tokens)
    ours.eval(tokens)
    np.testing.assert_array_equal(ours.scores[:200], reference.scores[:200])  # bit-identical logits
    assert ours.kv_stats()["tokens_evicted"] == 0
    if policy == "learned":
        assert ours.kv_stats()["captured_tensors"] == 2 * 30 * (200 // 64 + 1)

    prompt = "Write one sentence about the sea."
    expected = reference.create_completion(prompt, max_tokens=24, temperature=0.0)["choices"][0]["text"]
    got = ours.create_completion(prompt, max_tokens=24, temperature=0.0)["choices"][0]["text"]
    assert got == expected


def test_plain_llama_when_no_policy(model_path):
    llm = kvp_cpp.Llama(model_path, n_ctx=256, verbose=False)
    assert llm.kv_engine is None
    with pytest.raises(ValueError, match="exceed context window"):
        llm.create_completion("x " * 400, max_tokens=1)
    with pytest.raises(ValueError, match="needs a kv_policy"):
        llm.kv_stats()


# --- under eviction -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["streaming", "random", "learned"])
@pytest.mark.parametrize("flash_attn", [False, True])
def test_cache_stays_within_budget(model_path, random_policy_path, policy, flash_attn):
    budget = 96
    kv_policy = random_policy_path if policy == "learned" else policy
    llm = kvp_cpp.Llama(model_path, n_ctx=budget, n_batch=64, kv_policy=kv_policy, kv_sink=4, kv_recent=8,
                        flash_attn=flash_attn, verbose=False)
    assert llm.n_ctx() == 256  # llama.cpp pads to a multiple of 256; the budget is enforced by the engine
    tokens = long_prompt(llm, 4 * budget)  # a prompt of 4x the budget
    for chunk in (tokens[:150], tokens[150:]):
        llm.eval(chunk)
        assert_within_budget(llm, budget)
    out = llm.create_completion(llm.detokenize(tokens).decode(errors="ignore"), max_tokens=20, temperature=0.0)
    assert out["choices"][0]["finish_reason"] in ("stop", "length")
    stats = llm.kv_stats()
    positions = assert_within_budget(llm, budget)
    assert stats["tokens_evicted"] > 0 and stats["tokens_seen"] > 4 * budget - 10

    ledger = llm.kv_engine.ledger()
    n = llm.n_tokens
    assert ledger["logical"][:4].tolist() == [0, 1, 2, 3]  # sinks survive
    assert ledger["logical"][-8:].tolist() == list(range(n - 8, n))  # the recent window survives
    assert positions.max() < 8192
    if policy == "streaming":
        assert ledger["logical"][4:].tolist() == list(range(n - len(ledger["logical"]) + 4, n))


def test_planted_token_survives_heavy_eviction(model_path, tmp_path):
    planted = 37
    path = tmp_path / "planted.kvp.bin"
    pf.write_policy(path, planted_policy(planted))
    llm = kvp_cpp.Llama(model_path, n_ctx=64, kv_policy=str(path), kv_sink=2, kv_recent=4, verbose=False)
    llm.eval(long_prompt(llm, 600))
    ledger = llm.kv_engine.ledger()
    assert planted in ledger["logical"].tolist()
    assert llm.kv_stats()["tokens_evicted"] >= 600 - 64
    # the score is the policy's, untouched: 1000 for every head at the planted token, 0 elsewhere
    row = ledger["scores"][ledger["logical"].tolist().index(planted)]
    np.testing.assert_allclose(row, 1000.0, rtol=1e-6)
    assert np.all(ledger["scores"][ledger["logical"] != planted] == 0.0)


def test_compact_positions_stay_below_limit_and_compact_rarely(model_path):
    budget, limit = 64, 300
    llm = kvp_cpp.Llama(model_path, n_ctx=budget, n_batch=32, kv_policy="streaming", kv_compact_limit=limit,
                        kv_sink=4, kv_recent=8, verbose=False)
    tokens = long_prompt(llm, 1200)
    for start in range(0, len(tokens), 100):
        llm.eval(tokens[start:start + 100])
        assert cached_positions(llm).max() < limit
    stats = llm.kv_stats()
    # one compaction per ~(limit - budget) new tokens, one seq_add per contiguous run of kept tokens
    assert 1 <= stats["compactions"] <= 1200 // (limit - budget - 32) + 1
    assert stats["seq_add_calls"] <= stats["compactions"] * 3
    assert llm.create_completion(" The sky is", max_tokens=4, temperature=0.0)["choices"][0]["text"]


def test_original_positions_keep_growing(model_path):
    llm = kvp_cpp.Llama(model_path, n_ctx=64, kv_policy="streaming", kv_position_mode="original", verbose=False)
    llm.eval(long_prompt(llm, 500))
    positions = cached_positions(llm)
    assert positions.max() == 499 and len(positions) <= 64
    assert llm.kv_stats()["compactions"] == 0


def test_decode_evicts_in_batches(model_path):
    budget = 128
    llm = kvp_cpp.Llama(model_path, n_ctx=budget, kv_policy="streaming", kv_evict_fraction=0.25, verbose=False)
    llm.eval(long_prompt(llm, budget))
    rounds = llm.kv_stats()["eviction_rounds"]
    for token in long_prompt(llm, 80):
        llm.eval([token])
        assert_within_budget(llm, budget)
    # 80 single-token decodes past a full cache, shedding 32 tokens each time: 3 rounds, not 80
    assert llm.kv_stats()["eviction_rounds"] - rounds == 3


def test_reset_and_prefix_reuse(model_path):
    llm = kvp_cpp.Llama(model_path, n_ctx=64, kv_policy="streaming", verbose=False)
    llm.eval(long_prompt(llm, 300))
    llm.reset()
    assert llm.kv_stats()["cells_used"] == 0 and len(cached_positions(llm)) == 0

    # A prompt that extends the whole logical history reuses the cache...
    tokens = long_prompt(llm, 200)
    llm.eval(tokens[:150])
    seen = llm.kv_stats()["tokens_seen"]
    list(zip(range(1), llm.generate(tokens, temp=0.0)))
    assert llm.kv_stats()["tokens_seen"] - seen == 50
    # ...while a prompt that shares only an evicted prefix is re-prefilled under the budget.
    seen = llm.kv_stats()["tokens_seen"]
    list(zip(range(1), llm.generate(tokens[:100] + [13, 13], temp=0.0)))
    assert llm.kv_stats()["tokens_seen"] - seen == 102
    assert_within_budget(llm, 64)


def test_save_and_load_state_carry_the_ledger(model_path):
    llm = kvp_cpp.Llama(model_path, n_ctx=64, kv_policy="random", verbose=False)
    llm.eval(long_prompt(llm, 300))
    state = llm.save_state()
    assert isinstance(state, kvp_cpp.KvpLlamaState)
    first = llm.create_completion(" The sun is", max_tokens=8, temperature=0.0)["choices"][0]["text"]
    llm.load_state(state)
    assert llm.kv_engine.ledger()["logical"].max() == 299
    assert_within_budget(llm, 64)
    again = llm.create_completion(" The sun is", max_tokens=8, temperature=0.0)["choices"][0]["text"]
    assert again == first

    plain = llama_cpp.Llama(model_path, n_ctx=64, verbose=False)
    with pytest.raises(ValueError, match="without a kv_policy"):
        llm.load_state(plain.save_state())


def test_pickle_keeps_kv_arguments(model_path):
    llm = kvp_cpp.Llama(model_path, n_ctx=96, kv_policy="streaming", kv_sink=2, kv_recent=5, verbose=False)
    clone = pickle.loads(pickle.dumps(llm))
    assert clone.kv_stats()["budget"] == 96
    assert clone.kv_engine.policy_name == "streaming"
    assert clone._kvp_args == llm._kvp_args


def test_kv_stats_after_close_raises(model_path):
    llm = kvp_cpp.Llama(model_path, n_ctx=64, kv_policy="streaming", verbose=False)
    stats = llm.kv_stats()
    assert stats["kv_bytes_allocated"] == 256 * 30 * 2 * 3 * 64 * 2  # 256 cells, 30 layers, K+V, f16
    llm.close()
    with pytest.raises(RuntimeError, match="closed"):
        llm.kv_stats()


def test_kv_bytes_match_llama_cpp_log(model_path, capfd):
    llama_cpp.Llama(model_path, n_ctx=300, verbose=True)
    log = capfd.readouterr().err
    line = next(line for line in log.splitlines() if "llama_kv_cache: size" in line)
    mib = float(line.split("size =")[1].split("MiB")[0])
    llm = kvp_cpp.Llama(model_path, n_ctx=300, kv_policy="streaming", verbose=False)
    assert llm.kv_stats()["kv_bytes_allocated"] == pytest.approx(mib * 2**20, rel=1e-3)


# --- errors ---------------------------------------------------------------------------------------------------


def wrong_model_policy(tmp_path):
    path = tmp_path / "gemma.kvp.bin"
    pf.write_policy(path, pf.random_policy(arch="gemma3", n_layer=18, n_head_kv=1, head_dim_k=256, head_dim_v=256,
                                           n_ctx_train=32768, seed=0))
    return str(path)


def malformed_policy(tmp_path):
    path = tmp_path / "bad.kvp.bin"
    blob = bytearray(pf.encode_policy(pf.random_policy(**pf.smollm2_identity(), seed=0)))
    blob[200] ^= 0xFF
    path.write_bytes(bytes(blob))
    return str(path)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kv_policy="lru"), "unknown kv_policy 'lru'"),
        (dict(kv_policy="/nonexistent/p.kvp.bin"), "not found"),
        (dict(kv_policy=malformed_policy), "checksum"),
        (dict(kv_policy=wrong_model_policy), "trained for gemma3"),
        (dict(kv_policy="streaming", kv_budget=20, kv_sink=4, kv_recent=16), "at least kv_sink \\+ kv_recent \\+ 1"),
        (dict(kv_policy="streaming", kv_recent=0), "kv_recent must be >= 1"),
        (dict(kv_policy="streaming", kv_sink=-1), "kv_sink must be >= 0"),
        (dict(kv_policy="streaming", kv_budget=-5), "kv_budget -5"),
        (dict(kv_policy="streaming", kv_budget=1 << 30), "larger than any KV cache"),
        (dict(kv_policy="streaming", kv_budget=10000), "compact position limit"),
        (dict(kv_policy="streaming", kv_position_mode="shifted"), "kv_position_mode"),
        (dict(kv_policy="streaming", kv_head_combine="vote"), "kv_head_combine"),
        (dict(kv_policy="keydiff", kv_head_consensus=0.5), "kv_head_consensus applies to kv_mode='per_head' only"),
        (dict(kv_policy="keydiff", kv_head_consensus=1.5), "kv_head_consensus must be a number in \\[0, 1\\]"),
        (dict(kv_policy="keydiff", kv_head_consensus="half"), "kv_head_consensus must be a number"),
        (dict(kv_policy="streaming", kv_budget=2.5), "must be an integer"),
        (dict(kv_policy=3), "policy name or a path"),
    ],
)
def test_bad_arguments_raise_value_error(model_path, tmp_path, kwargs, message):
    kwargs = {k: (v(tmp_path) if callable(v) else v) for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=message):
        kvp_cpp.Llama(model_path, n_ctx=128, verbose=False, **kwargs)


def test_head_consensus_defaults_to_zero_in_shared_mode(model_path):
    """Unset (None), the consensus resolves per mode: 0 in shared mode (per-head mode's 0.9 is tested in
    test_per_head); an explicit 0 is accepted in shared mode."""
    assert kvp_cpp._core.DEFAULT_HEAD_CONSENSUS == 0.9
    for consensus in (None, 0):
        llm = kvp_cpp.Llama(model_path, n_ctx=128, kv_policy="keydiff", kv_head_consensus=consensus, verbose=False)
        assert llm._kvp_engine.head_consensus == 0.0


def test_logical_limit_and_logits_all(model_path):
    llm = kvp_cpp.Llama(model_path, n_ctx=64, kv_policy="streaming", kv_max_tokens=100, verbose=False)
    with pytest.raises(ValueError, match="kv_max_tokens=100"):
        llm.eval(long_prompt(llm, 150))
    llm = kvp_cpp.Llama(model_path, n_ctx=64, kv_policy="streaming", logits_all=True, verbose=False)
    with pytest.raises(ValueError, match="logits_all"):
        llm.eval(long_prompt(llm, 150))


def test_oneshot_compress(model_path, random_policy_path):
    llm = kvp_cpp.Llama(model_path, n_ctx=1024, kv_policy=random_policy_path, kv_sink=4, kv_recent=16, verbose=False)
    llm.eval(long_prompt(llm, 700))
    assert llm.kv_stats()["tokens_evicted"] == 0
    scores = llm.kv_engine.ledger()["scores"].astype(np.float64)  # (700, 90): one column per (layer, head)
    assert llm.kv_compress(128) == 700 - 128
    positions = assert_within_budget(llm, 128)
    ledger = llm.kv_engine.ledger()
    assert ledger["logical"][:4].tolist() == [0, 1, 2, 3] and ledger["logical"][-16:].tolist() == list(range(684, 700))
    # the kept middle is the top of the default combination, recomputed here: the sum over columns of each
    # column's softmax over the unprotected tokens
    candidates = scores[4:684]
    probabilities = np.exp(candidates - candidates.max(axis=0))
    keep = (probabilities / probabilities.sum(axis=0)).sum(axis=1)
    expected = sorted((4 + np.argsort(-keep, kind="stable")[:128 - 20]).tolist())
    assert ledger["logical"][4:-16].tolist() == expected
    assert len(positions) == 128 and llm.kv_stats()["budget"] == 128
    llm.eval(long_prompt(llm, 100))  # continues under the new budget
    assert_within_budget(llm, 128)
    with pytest.raises(ValueError, match="cannot compress to 10 cells"):
        llm.kv_compress(10)


def test_recency_terms_join_the_scores_when_ranking(model_path, tmp_path):
    data = pf.random_policy(**pf.smollm2_identity(), hidden=(16,), seed=3)
    rng = np.random.default_rng(11)
    data.recency = {key: (rng.standard_normal(12) * 3).astype(np.float32) for key in sorted(data.agents)}
    path = tmp_path / "recency.kvp.bin"
    pf.write_policy(path, data)
    llm = kvp_cpp.Llama(model_path, n_ctx=1024, kv_policy=str(path), kv_sink=4, kv_recent=16, verbose=False)
    llm.eval(long_prompt(llm, 700))
    scores = llm.kv_engine.ledger()["scores"].astype(np.float64)  # (700, 90) as the MLP wrote them
    ages = 700 - np.arange(700)
    recency = np.concatenate([pf.recency_terms(data, layer, ages) for layer in range(data.n_layer)], axis=1)
    llm.kv_compress(128)
    ledger = llm.kv_engine.ledger()

    def top(columns):
        candidates = columns[4:684]
        probabilities = np.exp(candidates - candidates.max(axis=0))
        keep = (probabilities / probabilities.sum(axis=0)).sum(axis=1)
        return sorted((4 + np.argsort(-keep, kind="stable")[: 128 - 20]).tolist())

    ranked = (scores.astype(np.float32) + recency).astype(np.float32).astype(np.float64)
    assert ledger["logical"][4:-16].tolist() == top(ranked)
    assert top(ranked) != top(scores)  # the terms changed the choice
    # the ledger keeps the scores as written; the terms depend on the moment of each eviction
    np.testing.assert_array_equal(ledger["scores"], scores[ledger["logical"]].astype(np.float32))


def test_recency_terms_turn_a_keep_the_oldest_policy_into_streaming(model_path, tmp_path):
    # the MLP keeps the oldest tokens (its score falls with the position feature p / 8192) ...
    data = pf.random_policy(**pf.smollm2_identity(), hidden=(), seed=0)
    for agent in data.agents.values():
        weight = np.zeros_like(agent.weights[0])
        weight[0, -1] = -50.0
        agent.weights, agent.biases = [weight], [np.zeros_like(agent.biases[0])]
    # ... and recency terms that fall faster with age turn it into streaming
    data.recency = {key: -4.0 * np.arange(14, dtype=np.float32) for key in sorted(data.agents)}
    path = tmp_path / "recency_only.kvp.bin"
    pf.write_policy(path, data)
    llm = kvp_cpp.Llama(model_path, n_ctx=128, kv_policy=str(path), kv_sink=4, kv_recent=8, verbose=False)
    llm.eval(long_prompt(llm, 600))
    logical = llm.kv_engine.ledger()["logical"].tolist()
    assert llm.kv_stats()["tokens_evicted"] >= 600 - 128
    assert logical[:4] == [0, 1, 2, 3] and logical[4:] == list(range(600 - len(logical) + 4, 600))
    data.recency = {}
    pf.write_policy(path, data)
    llm = kvp_cpp.Llama(model_path, n_ctx=128, kv_policy=str(path), kv_sink=4, kv_recent=8, verbose=False)
    llm.eval(long_prompt(llm, 600))
    assert llm.kv_engine.ledger()["logical"].tolist()[:80] == list(range(80))  # without them the oldest stay


def test_set_budget_after_compress_appends_without_evicting(model_path):
    """The oneshot protocol of kvpress and the paper: compress once, then the question and answer are appended."""
    llm = kvp_cpp.Llama(model_path, n_ctx=1024, kv_policy="knorm", verbose=False)
    llm.eval(long_prompt(llm, 600))
    llm.kv_compress(200)
    kept = llm.kv_engine.ledger()["logical"].tolist()
    llm.kv_set_budget(260)
    llm.eval(long_prompt(llm, 60))
    stats = llm.kv_stats()
    assert stats["cells_used"] == 260 and stats["budget"] == 260 and stats["tokens_evicted"] == 400
    assert llm.kv_engine.ledger()["logical"].tolist() == kept + list(range(600, 660))
    assert_within_budget(llm, 260)
    llm.eval(long_prompt(llm, 10))  # past the raised budget: evicts again
    assert_within_budget(llm, 260)
    with pytest.raises(ValueError, match="cannot set the budget to 100 cells: the cache holds 2[0-9][0-9] "):
        llm.kv_set_budget(100)
    with pytest.raises(ValueError, match="the context has 1024"):
        llm.kv_set_budget(5000)
    with pytest.raises(ValueError, match="kv_sink \\+ kv_recent \\+ 1"):
        llm.kv_set_budget(3)
    with pytest.raises(ValueError, match="integer budget"):
        llm.kv_set_budget(2.5)


def test_forget_from_keeps_the_cached_part_of_the_prefix(model_path):
    """Engine.forget_from (a conversation cut back to an earlier turn): after evictions, the tokens from n on leave
    the ledger and llama.cpp's cells, those before n that the cache holds stay with their scores, and the next
    tokens continue from logical index n; truncate refuses the same cut because part of the prefix is gone."""
    llm = kvp_cpp.Llama(model_path, n_ctx=128, kv_policy="keydiff", verbose=False)
    llm.eval(long_prompt(llm, 400))
    before = llm.kv_engine.ledger()
    n = int(before["logical"][len(before["logical"]) // 2])  # a cached token in the middle of the cache
    assert not llm.kv_engine.truncate(n)
    seq_rm_calls = llm.kv_stats()["seq_rm_calls"]
    assert llm.kv_engine.forget_from(n)
    after = llm.kv_engine.ledger()
    kept = before["logical"] < n
    assert after["logical"].tolist() == before["logical"][kept].tolist()
    assert after["cache_pos"].tolist() == before["cache_pos"][kept].tolist()
    assert np.array_equal(after["scores"], before["scores"][kept])
    assert sorted(cached_positions(llm).tolist()) == after["cache_pos"].tolist()
    assert llm.kv_engine.logical_length == n and llm.kv_stats()["seq_rm_calls"] == seq_rm_calls + 1
    assert llm.kv_engine.forget_from(10**6)  # nothing to forget
    llm.n_tokens = n
    llm.eval(long_prompt(llm, 50))
    ledger = llm.kv_engine.ledger()
    assert ledger["logical"].max() == n + 49 and llm.kv_engine.logical_length == n + 50
    assert_within_budget(llm, 128)


def test_shipped_policy_by_name(model_path):
    shipped = kvp_cpp.shipped_policies()
    assert "smollm2-135m-instruct" in shipped
    llm = kvp_cpp.Llama(model_path, n_ctx=128, kv_policy="kvp", verbose=False)
    assert llm.kv_engine.policy_name == "kvp" and llm.kv_stats()["budget"] == 128
    llm.eval(long_prompt(llm, 400))
    assert_within_budget(llm, 128)
    assert llm.kv_stats()["captured_tensors"] > 0
    with pytest.raises(ValueError, match="no shipped KVP policy matches this model"):
        kvp_cpp.shipped_policy_for(dict(pf.smollm2_identity(), n_layer=12))


def test_shipped_chat_policy_by_name(model_path):
    """kv_policy="kvp-chat" is MODEL.chat.kvp.bin, "kvp" stays MODEL.kvp.bin although the chat file sorts first."""
    shipped = kvp_cpp.shipped_policies()
    identity = kvp_cpp.model_identity(model_path)
    assert kvp_cpp.shipped_policy_for(identity) == shipped["smollm2-135m-instruct"]
    assert kvp_cpp.shipped_policy_for(identity, "chat") == shipped["smollm2-135m-instruct.chat"]
    assert pf.read_policy(shipped["smollm2-135m-instruct.chat"]).identity() == pf.read_policy(
        shipped["smollm2-135m-instruct"]).identity()
    llm = kvp_cpp.Llama(model_path, n_ctx=128, kv_policy="kvp-chat", verbose=False)
    assert llm.kv_engine.policy_name == "kvp"
    llm.eval(long_prompt(llm, 400))
    assert_within_budget(llm, 128)
    chat_kept = sorted(llm.kv_engine.ledger()["logical"].tolist())
    default = kvp_cpp.Llama(model_path, n_ctx=128, kv_policy="kvp", verbose=False)
    default.eval(long_prompt(default, 400))
    assert sorted(default.kv_engine.ledger()["logical"].tolist()) != chat_kept  # another policy, other tokens kept
    gemma = {"arch": "gemma3", "n_layer": 18, "n_head_kv": 1, "head_dim_k": 256, "head_dim_v": 256,
             "n_ctx_train": 32768}
    with pytest.raises(ValueError, match="no shipped KVP chat policy matches this model"):
        kvp_cpp.shipped_policy_for(gemma, "chat")
    with pytest.raises(ValueError, match="unknown shipped policy variant 'code'"):
        kvp_cpp.shipped_policy_for(identity, "code")
