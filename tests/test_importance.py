"""The attention recomputed from captured post-RoPE Q, K, V equals llama.cpp's own (the basis of the targets)."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for training/

from kvp_cpp.capture import TensorCapture
from training.importance import attention_output, causal_attention, importance

LAYERS = [0, 13, 29]


@pytest.fixture(scope="module")
def captured(model_path):
    capture = TensorCapture(model_path, names=("Qcur", "Kcur", "Vcur", "kqv_out", "kq_soft_max"), layers=LAYERS,
                            n_ctx=512, n_batch=64)
    tokens = capture.llm.tokenize(b"The grass is green. The sky is blue. One magic number is 4821. " * 6)[:150]
    out = capture.run(tokens)
    capture.close()
    return tokens, out


def test_capture_shapes(captured):
    tokens, out = captured
    n = len(tokens)
    assert out["Qcur"][0].shape == (n, 9, 64)
    assert out["Kcur"][13].shape == (n, 3, 64) and out["Vcur"][29].shape == (n, 3, 64)
    assert out["kqv_out"][0].shape == (n, 576)
    assert set(out["Kcur"]) == set(LAYERS)


@pytest.mark.parametrize("layer", LAYERS)
def test_recomputed_attention_output_matches_kqv_out(captured, layer):
    _, out = captured
    q, k, v = (out[name][layer].astype(np.float16) for name in ("Qcur", "Kcur", "Vcur"))  # as the f16 cache holds them
    ours = attention_output(q, k, v, scale=1 / np.sqrt(64)).reshape(len(q), -1)
    theirs = out["kqv_out"][layer]
    np.testing.assert_allclose(ours, theirs, rtol=1e-3, atol=1e-3 * np.abs(theirs).max())


@pytest.mark.parametrize("layer", LAYERS)
def test_recomputed_weights_match_kq_soft_max(captured, layer):
    _, out = captured
    # llama.cpp multiplies with K from its f16 cache and converts Q to f16 for that product
    q, k = out["Qcur"][layer].astype(np.float16), out["Kcur"][layer].astype(np.float16)
    first = 0
    for chunk in out["kq_soft_max"][layer]:      # (1, n_head, ubatch, n_kv cells)
        weights = chunk[0].transpose(1, 0, 2)     # (ubatch, n_head, n_kv)
        m = weights.shape[0]
        ours = causal_attention(q[first:first + m], k[:first + m], 1 / np.sqrt(64), first)
        np.testing.assert_allclose(weights[:, :, :first + m], ours, atol=1e-4)
        assert np.all(weights[:, :, first + m:] == 0)
        first += m


def softmax(logits):
    p = np.exp(logits - logits.max())
    return p / p.sum()


def test_importance_sums_future_attention():
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((40, 9, 8)), rng.standard_normal((40, 3, 8))
    imp = importance(q, k, cut=30, n_future=10, scale=0.5)
    assert imp.shape == (3, 30)
    brute = np.zeros((3, 30))
    for j in range(30, 40):
        per_head = np.stack([softmax(q[j, h] @ k[: j + 1, h // 3].T * 0.5)[:30] for h in range(9)])
        brute += per_head.reshape(3, 3, 30).max(axis=1)  # max over each KV head's group of 3 query heads
    np.testing.assert_allclose(imp, brute, rtol=1e-10)


def test_windowed_importance_sees_only_the_window():
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((40, 4, 8)), rng.standard_normal((40, 1, 8))
    window = 7
    imp = importance(q, k, cut=30, n_future=10, scale=0.5, window=window)
    brute = np.zeros((1, 30))
    for j in range(30, 40):
        first = j - window + 1  # query j sees keys j-window+1 .. j, as llama.cpp's standard sliding-window mask
        per_head = np.zeros((4, 30))
        for h in range(4):
            weights = softmax(q[j, h] @ k[first: j + 1, 0].T * 0.5)
            per_head[h, min(first, 30):30] = weights[: max(0, 30 - first)]
        brute += per_head.max(axis=0)
    np.testing.assert_allclose(imp, brute, rtol=1e-10)
    assert np.all(imp[:, : 30 - window + 1] == 0) and np.all(imp[:, 30 - window + 1:] > 0)  # only the first window
