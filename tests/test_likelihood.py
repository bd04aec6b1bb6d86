"""training.likelihood: the answer's negative log-likelihood, and the same after removing tokens from a prefilled
cache against the engine's own eviction of those tokens."""
from __future__ import annotations

import numpy as np
import pytest

from training import likelihood


def test_mean_nll_is_the_mean_negative_log_softmax_of_the_targets():
    logits = np.array([[0.0, 1.0, 2.0], [5.0, 5.0, 5.0]])
    expected = (-(2.0 - np.log(1 + np.e + np.e ** 2)) + np.log(3)) / 2
    assert likelihood.mean_nll(logits, [2, 0]) == pytest.approx(expected)
    assert likelihood.mean_nll(np.array([[1000.0, 0.0]]), [0]) == pytest.approx(0.0, abs=1e-12)  # no overflow


def test_answer_likelihood_after_removal_matches_the_engines_eviction():
    import llama_cpp

    from kvp_cpp import Llama, default_model_path

    model = default_model_path()
    text = " ".join(["alpha", "beta", "gamma", "delta"] * 40) + " The key is 7731. What is the key? The key is"
    stock = llama_cpp.Llama(model, n_ctx=512, verbose=False)
    prompt = stock.tokenize(text.encode(), add_bos=False, special=True)
    answer = stock.tokenize(b" 7731", add_bos=False, special=False)
    n, tail = len(prompt) - 1, prompt[-1:] + answer[:-1]
    scorer = likelihood.AnswerLikelihood(stock)
    state = scorer.prefill(prompt[:-1])
    full = scorer.nll(state, np.ones(n, bool), tail, answer)
    budget = 48
    streaming = np.zeros(n, bool)
    streaming[:4] = True
    streaming[n - (budget - 4):] = True
    removed = scorer.nll(state, streaming, tail, answer)
    assert scorer.nll(state, np.ones(n, bool), tail, answer) == full  # the state is restored every time
    engine = Llama(model, n_ctx=512, kv_policy="streaming", kv_evict_unit="token", verbose=False)
    engine.kv_set_budget(512)
    engine.eval(prompt[:-1])
    engine.kv_compress(budget)
    engine.kv_set_budget(512)
    assert sorted(engine.kv_engine.ledger()["logical"]) == np.flatnonzero(streaming).tolist()
    by_engine = likelihood.AnswerLikelihood(engine).nll(engine.save_state(), np.ones(n, bool), tail, answer)
    assert removed == pytest.approx(by_engine, abs=2e-3)
    assert abs(removed - full) > 1e-3  # the removal changed what the model reads
