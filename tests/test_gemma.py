"""Gemma 3 (interleaved sliding-window cache): eviction acts on both caches and never touches the window; the
training targets follow its sliding-window layers."""
import os
import sys

import numpy as np
import pytest

import kvp_cpp
from kvp_cpp import policy_file as pf

from conftest import cached_positions, gemma_model_path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for training/


@pytest.fixture(scope="module")
def gemma_path():
    return gemma_model_path()


def test_gemma_identity(gemma_path):
    assert kvp_cpp.model_identity(gemma_path) == dict(arch="gemma3", n_layer=18, n_head_kv=1, head_dim_k=256,
                                                      head_dim_v=256, n_ctx_train=32768)


@pytest.mark.parametrize("policy", ["streaming", "learned", "kvp"])  # kvp: the shipped Gemma policy
def test_gemma_eviction_keeps_the_sliding_window(gemma_path, tmp_path, policy):
    if policy == "kvp":
        shipped = pf.read_policy(kvp_cpp.shipped_policy_for(kvp_cpp.model_identity(gemma_path)))
        assert [layer for layer in range(18) if shipped.layer_scored[layer]] == [5, 11, 17]  # the global layers
        assert shipped.n_recent == 512
    if policy == "learned":
        policy = str(tmp_path / "gemma.kvp.bin")
        pf.write_policy(policy, pf.random_policy(**kvp_cpp.model_identity(gemma_path), hidden=(16,)))
    budget, window, n = 640, 512, 1600
    llm = kvp_cpp.Llama(gemma_path, n_ctx=budget, kv_policy=policy, verbose=False)
    tokens = llm.tokenize(b"The grass is green. The sky is blue. " * 200)[:n]
    llm.eval(tokens)
    stats = llm.kv_stats()
    assert stats["cells_used"] <= budget and stats["tokens_evicted"] >= n - budget
    assert len(cached_positions(llm)) == stats["cells_used"]  # the global-attention cache, read from llama.cpp
    logical = set(llm.kv_engine.ledger()["logical"].tolist())
    assert set(range(n - window, n)) <= logical  # every token of the sliding window is still cached
    if policy != "streaming":
        assert stats["captured_tensors"] > 0
    assert llm.create_completion(" The sky is", max_tokens=3, temperature=0.0)["choices"][0]["text"]


def test_gemma_budget_must_cover_the_window(gemma_path):
    with pytest.raises(ValueError, match="sliding window, 512 tokens"):
        kvp_cpp.Llama(gemma_path, n_ctx=256, kv_policy="streaming", verbose=False)


def test_sliding_layers_follow_llama_cpp(gemma_path, model_path):
    from kvp_cpp.capture import TensorCapture
    from training.capture_traces import sliding_layers

    for path, expected in ((gemma_path, (512, [l for l in range(18) if l not in (5, 11, 17)])), (model_path, (0, []))):
        identity = kvp_cpp.model_identity(path)
        capture = TensorCapture(path, names=("Kcur",), layers=[0], n_ctx=256, n_batch=64)
        try:
            assert sliding_layers(capture.llm, identity["arch"], identity["n_layer"]) == expected
        finally:
            capture.close()


def test_capture_checks_the_recomputed_attention_in_every_layer(gemma_path):
    """The targets' attention, with the window in the sliding layers, is llama.cpp's own in all 18 layers over 640
    tokens (past the 512-token window); without the window the check refuses the first sliding layer."""
    from training.capture_traces import check_recomputed_attention

    sliding = [layer for layer in range(18) if layer not in (5, 11, 17)]
    assert check_recomputed_attention(gemma_path, 1 / np.sqrt(256), 512, sliding) < 1e-3
    with pytest.raises(ValueError, match="in layer 0, the attention recomputed from Qcur/Kcur/Vcur differs"):
        check_recomputed_attention(gemma_path, 1 / np.sqrt(256), 0, [])
