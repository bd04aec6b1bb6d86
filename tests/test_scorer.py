"""The scorer against a float64 numpy reference, on every CPU kernel this machine runs."""
import numpy as np
import pytest

import kvp_cpp
from kvp_cpp import policy_file as pf

SHAPES = [
    dict(n_head_kv=3, head_dim_k=64, head_dim_v=64, hidden=(32,), activation="relu", weight_dtype="f32"),
    dict(n_head_kv=2, head_dim_k=13, head_dim_v=9, hidden=(17, 5), activation="gelu_tanh", weight_dtype="f32"),
    dict(n_head_kv=1, head_dim_k=64, head_dim_v=64, hidden=(100,), activation="silu", weight_dtype="f16"),
    dict(n_head_kv=4, head_dim_k=31, head_dim_v=33, hidden=(), activation="tanh", weight_dtype="f32"),
    dict(n_head_kv=3, head_dim_k=64, head_dim_v=64, hidden=(64, 64, 7), activation="tanh", weight_dtype="f16"),
]


def make_policy(seed, shape, pos=None):
    data = pf.random_policy(arch="test", n_layer=3, n_ctx_train=4096, seed=seed, pos=pos,
                            layer_scored=[True, False, True], **shape)
    return data, kvp_cpp.parse_policy(pf.encode_policy(data))


def assert_close(actual, reference):
    np.testing.assert_allclose(actual, reference, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(reference).max())))


@pytest.mark.parametrize("kernel", kvp_cpp.available_kernels())
@pytest.mark.parametrize("shape_index", range(len(SHAPES)))
@pytest.mark.parametrize("n_tokens", [1, 31, 33, 100])
def test_scores_match_float64_reference(kernel, shape_index, n_tokens):
    shape = SHAPES[shape_index]
    data, policy = make_policy(shape_index, shape)
    rng = np.random.default_rng(n_tokens)
    k = rng.standard_normal((n_tokens, shape["n_head_kv"], shape["head_dim_k"])).astype(np.float32) * 2
    v = rng.standard_normal((n_tokens, shape["n_head_kv"], shape["head_dim_v"])).astype(np.float32)
    positions = rng.integers(0, 20000, n_tokens).astype(np.int64)  # beyond n_ctx_train too
    for layer in (0, 2):
        reference = pf.reference_scores(data, layer, k.astype(np.float64), v.astype(np.float64), positions)
        for threads in (1, 2):
            scores = kvp_cpp.Scorer(policy, kernel=kernel, n_threads=threads).score_layer(layer, k, v, positions)
            assert scores.shape == (n_tokens, shape["n_head_kv"]) and scores.dtype == np.float32
            assert_close(scores, reference)


def test_every_position_feature_kind_matches_reference():
    features = [(0, 8192.0), (1, float(np.log1p(8192))), (2, 0.01), (3, 0.003)]
    data, policy = make_policy(7, SHAPES[0], pos=features)
    positions = np.array([0, 1, 5, 4095, 8191, 8192, 100000], dtype=np.int64)
    np.testing.assert_allclose(kvp_cpp._core.pos_features(policy, positions), pf.pos_features(features, positions),
                               rtol=1e-6, atol=1e-6)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((len(positions), 3, 64)).astype(np.float32)
    v = rng.standard_normal((len(positions), 3, 64)).astype(np.float32)
    scores = kvp_cpp.Scorer(policy).score_layer(0, k, v, positions)
    assert_close(scores, pf.reference_scores(data, 0, k.astype(np.float64), v.astype(np.float64), positions))


def test_empty_block_and_errors():
    _, policy = make_policy(0, SHAPES[0])
    scorer = kvp_cpp.Scorer(policy)
    empty = np.zeros((0, 3, 64), np.float32)
    assert scorer.score_layer(0, empty, empty, np.zeros(0, np.int64)).shape == (0, 3)
    good = np.zeros((4, 3, 64), np.float32)
    with pytest.raises(ValueError, match="layer 1 has no agents"):
        scorer.score_layer(1, good, good, np.arange(4, dtype=np.int64))
    with pytest.raises(ValueError, match="do not match"):
        scorer.score_layer(0, np.zeros((4, 2, 64), np.float32), good, np.arange(4, dtype=np.int64))
    with pytest.raises(ValueError, match="one entry per token"):
        scorer.score_layer(0, good, good, np.arange(3, dtype=np.int64))
    with pytest.raises(ValueError):
        kvp_cpp.Scorer(policy, kernel="sse9")


def test_flops_per_token():
    _, policy = make_policy(1, SHAPES[1])  # D = 13 + 9 + 2, hidden 17 then 5, two scored layers x 2 heads
    d = 13 + 9 + 2
    per_agent = 2 * d + 2 * d * 17 + 2 * 17 * 5 + 2 * 5
    assert kvp_cpp.Scorer(policy).flops_per_token == 2 * 2 * per_agent
