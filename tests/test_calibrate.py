"""training.calibrate: per-agent temperatures that keep each head's ranking and fit the listwise loss."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvp_cpp import policy_file as pf  # noqa: E402
from training import calibrate  # noqa: E402
from training.evaluate import policy_score_fn  # noqa: E402
from training.traces import LayerTrace  # noqa: E402

MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")


def test_the_cross_entropy_is_lowest_at_the_planted_temperature():
    rng = np.random.default_rng(0)
    scores = rng.normal(size=300)
    for planted in (0.05, 0.8, 3.0, 40.0):
        importance = np.exp(planted * scores - (planted * scores).max())  # exactly softmax(planted * scores), unnormalised
        loss = calibrate.cross_entropy_by_temperature(scores, importance * 7.0, calibrate.DEFAULT_GRID)
        best = calibrate.DEFAULT_GRID[int(np.argmin(loss))]
        assert abs(np.log(best / planted)) <= np.log(calibrate.DEFAULT_GRID[1] / calibrate.DEFAULT_GRID[0])


def test_calibrated_agents_score_exactly_t_times_and_keep_their_order():
    policy = pf.read_policy(os.path.join(MODELS, "smollm2-135m-instruct.kvp.bin"))  # has recency terms
    assert policy.recency
    rng = np.random.default_rng(1)
    temperatures = {agent: float(rng.uniform(0.1, 3.0)) for agent in policy.agents}
    scaled = calibrate.calibrated(policy, temperatures)
    assert scaled.metadata["calibration"]["temperature_max"] == max(temperatures.values())
    assert "heldout" in policy.metadata and "heldout" not in scaled.metadata  # measured before calibration
    cut, layer = 300, 7
    trace = LayerTrace(sequence_id=0, cut=cut, layer=layer,
                       k=rng.normal(size=(policy.n_head_kv, cut, policy.head_dim_k)).astype(np.float32),
                       v=rng.normal(size=(policy.n_head_kv, cut, policy.head_dim_v)).astype(np.float32),
                       positions=np.arange(cut, dtype=np.int64), importance=np.ones((policy.n_head_kv, cut), np.float32))
    before = np.asarray(policy_score_fn(policy)(trace), dtype=np.float64)
    after = np.asarray(policy_score_fn(scaled)(trace), dtype=np.float64)
    for head in range(policy.n_head_kv):
        t = temperatures[layer, head]
        np.testing.assert_allclose(after[head], t * before[head], rtol=1e-5, atol=1e-5)
        assert (np.argsort(-after[head], kind="stable") == np.argsort(-before[head], kind="stable")).mean() > 0.99


def test_calibration_refuses_missing_or_non_positive_temperatures():
    policy = pf.read_policy(os.path.join(MODELS, "smollm2-135m-instruct.chat.kvp.bin"))
    temperatures = {agent: 1.0 for agent in policy.agents}
    zero = dict(temperatures)
    zero[next(iter(zero))] = 0.0
    with pytest.raises(ValueError, match="positive"):
        calibrate.calibrated(policy, zero)
    del temperatures[next(iter(temperatures))]
    with pytest.raises(ValueError, match="every agent"):
        calibrate.calibrated(policy, temperatures)
