"""training.e2e: the Plackett–Luce picks' log-probability against brute force, the shared score, the kept set, and
a short fine-tuning run that writes a loadable policy (its reward: tests/test_likelihood.py)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvp_cpp import policy_file as pf  # noqa: E402
from training import e2e  # noqa: E402


def test_picks_log_prob_matches_the_sequential_choice_probabilities():
    logits = torch.tensor([0.3, -1.2, 2.0, 0.5, 0.0], dtype=torch.float64)
    n, n_picks = logits.shape[0], 2
    weights = torch.exp(logits).numpy()
    total = 0.0
    for picks in itertools.permutations(range(n), n_picks):
        rest = [i for i in range(n) if i not in picks]
        order = torch.tensor([list(picks) + rest])
        p = 1.0
        remaining = list(range(n))
        for pick in picks:  # choose `pick` among what is left, with probability proportional to exp(logit)
            p *= weights[pick] / weights[remaining].sum()
            remaining.remove(pick)
        assert float(e2e.picks_log_prob(logits, order, n_picks)[0]) == pytest.approx(np.log(p), rel=1e-12)
        total += p
    assert total == pytest.approx(1.0)  # the ordered picks of size 2 are a distribution
    # the tail's order does not matter, and no picks have probability one
    order = torch.tensor([[2, 0, 1, 3, 4], [2, 0, 4, 3, 1]])
    values = e2e.picks_log_prob(logits, order, 2)
    assert float(values[0]) == float(values[1])
    assert float(e2e.picks_log_prob(logits, order, 0)[0]) == 0.0


def test_shared_log_score_is_the_log_of_the_summed_softmaxes():
    scores = torch.tensor([[0.0, 1.0, 2.0], [3.0, -1.0, 0.5]], dtype=torch.float64)
    softmax = np.exp(scores.numpy()) / np.exp(scores.numpy()).sum(-1, keepdims=True)
    np.testing.assert_allclose(e2e.shared_log_score(scores).numpy(), np.log(softmax.sum(0)), rtol=1e-12)


def test_kept_mask_keeps_sinks_recent_and_the_first_picks():
    kept = e2e.kept_mask(12, 2, 3, np.array([4, 0, 6, 1, 2, 3, 5]), 2)
    assert np.flatnonzero(kept).tolist() == [0, 1, 2, 6, 9, 10, 11]


def test_held_out_samples_are_the_ones_capture_traces_holds_out():
    assert e2e.pick_samples(range(30), 12, heldout=False) == [0, 1, 2, 3, 5, 6, 7, 8, 10, 11, 12, 13]
    assert e2e.pick_samples(range(30), 3, heldout=True) == [4, 9, 14]


def test_per_agent_picks_log_prob_is_the_sum_of_each_agents():
    """Per head, each agent's picks are drawn from its own logits: (K, A) log-probabilities, each the agent's own."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 7, generator=g, dtype=torch.float64)
    orders = torch.stack([torch.stack([torch.randperm(7, generator=g) for _ in range(3)]) for _ in range(4)])
    joint = e2e.picks_log_prob(logits, orders, 3)
    assert joint.shape == (4, 3)
    for a in range(3):
        torch.testing.assert_close(joint[:, a], e2e.picks_log_prob(logits[a], orders[:, a], 3))


def _tiny_init(tmp_path):
    init = tmp_path / "init.kvp.bin"
    policy = pf.random_policy(**pf.smollm2_identity(), hidden=(4,), seed=3)
    policy.recency = {slot: np.linspace(-0.5, 0.5, 14).astype(np.float32) for slot in policy.agents}
    pf.write_policy(init, policy)
    return ["--init", str(init), "--tasks", "niah_single_1", "--samples-per-task", "1", "--length", "512",
            "--budgets", "128", "--steps", "2", "--samples", "3", "--quiet", "-t", "2"]


def test_a_short_run_fine_tunes_and_writes_a_loadable_policy(tmp_path):
    from kvp_cpp import _core

    run = _tiny_init(tmp_path)
    init = tmp_path / "init.kvp.bin"
    out = tmp_path / "e2e.kvp.bin"
    e2e.main(run + ["--out", str(out), "--heldout-samples", "1"])
    before, after = pf.read_policy(init), pf.read_policy(out)
    assert after.identity() == before.identity() and after.hidden == before.hidden
    changed = [not np.array_equal(after.agents[s].weights[0], before.agents[s].weights[0]) for s in before.agents]
    assert any(changed)
    assert any(not np.array_equal(after.recency[s], before.recency[s]) for s in before.agents)
    record = after.metadata["e2e"]
    assert record["steps"] == 2 and record["episodes"] == 1 and record["heldout_episodes"] == 1
    assert np.isfinite([record[f"{split}greedy_nll_{when}"] for split in ("", "heldout_")
                        for when in ("before", "after")]).all()
    _core.load_policy(str(out))  # the C++ loader accepts it


def test_a_stopped_run_resumes_to_the_policy_of_an_unbroken_one(tmp_path):
    run = _tiny_init(tmp_path)
    whole, parts = tmp_path / "whole.kvp.bin", tmp_path / "parts.kvp.bin"
    e2e.main(run + ["--out", str(whole)])
    e2e.main(run + ["--out", str(parts), "--stop-at", "1"])
    assert not parts.exists() and (tmp_path / "parts.kvp.bin.ckpt").exists()
    for other_run in (["--lr", "0.01"], ["--heldout-samples", "1"]):
        with pytest.raises(ValueError, match="another run"):
            e2e.main(run + ["--out", str(parts), "--resume"] + other_run)
    checkpoint = torch.load(tmp_path / "parts.kvp.bin.ckpt", weights_only=True)
    del checkpoint["config"]["heldout_samples"]  # as checkpoints written before it was a run key
    torch.save(checkpoint, tmp_path / "parts.kvp.bin.ckpt")
    e2e.main(run + ["--out", str(parts), "--resume"])
    a, b = pf.read_policy(whole), pf.read_policy(parts)
    for slot in a.agents:
        for x, y in zip(a.agents[slot].weights + a.agents[slot].biases, b.agents[slot].weights + b.agents[slot].biases):
            np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(a.recency[slot], b.recency[slot])
    for key in ("greedy_nll_before", "greedy_nll_after"):
        assert a.metadata["e2e"][key] == b.metadata["e2e"][key]
    measured_only = tmp_path / "measured.kvp.bin"  # --steps 0: the --init policy, measured
    e2e.main(run[:run.index("--steps")] + ["--steps", "0", "--out", str(measured_only)])
    c, init = pf.read_policy(measured_only), pf.read_policy(tmp_path / "init.kvp.bin")
    np.testing.assert_array_equal(c.agents[(0, 0)].weights[0], init.agents[(0, 0)].weights[0])
    assert c.metadata["e2e"]["greedy_nll_before"] == c.metadata["e2e"]["greedy_nll_after"] == \
        a.metadata["e2e"]["greedy_nll_before"]


def test_bad_input_is_refused_with_the_reason(tmp_path):
    other = tmp_path / "other.kvp.bin"
    pf.write_policy(other, pf.random_policy(arch="llama", n_layer=2, n_head_kv=1, head_dim_k=8, head_dim_v=8,
                                            n_ctx_train=512, hidden=(4,)))
    with pytest.raises(ValueError, match="trained for another model"):
        e2e.main(["--init", str(other), "--out", str(tmp_path / "x.kvp.bin"), "--steps", "1", "--quiet"])
    with pytest.raises(SystemExit):
        e2e.parse_args(["--init", str(other), "--out", "x", "--tasks", "niah_single_1,qa_1"])
    with pytest.raises(SystemExit):
        e2e.parse_args(["--init", str(other), "--out", "x", "--samples", "1"])
    with pytest.raises(SystemExit):
        e2e.parse_args(["--init", str(other), "--out", "x", "--steps", "-1"])
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        e2e.main(_tiny_init(tmp_path) + ["--out", str(tmp_path / "none.kvp.bin"), "--resume"])
