"""The trainer (training/): trace reader, Plackett–Luce / reward math, RLOO and supervised runs, export, evaluation."""
import itertools
import json
import math
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

# The training package lives at the repository root, not in the installed kvp_cpp wheel.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kvp_cpp  # noqa: E402
from kvp_cpp import policy_file as pf  # noqa: E402
from training import evaluate as ev  # noqa: E402
from training import rl  # noqa: E402
from training import train as tr  # noqa: E402
from training.traces import TraceFormatError, TraceSet, write_synthetic_traces  # noqa: E402


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    root = tmp_path_factory.mktemp("traces")
    truth = write_synthetic_traces(root, seed=3)
    return str(root), truth


def run_training(traces_dir, out, *extra):
    argv = ["--traces", traces_dir, "--out", str(out), "--hidden", "16", "--lr", "1e-2", "--seed", "0",
            "--reproducible", "--quiet", *extra]  # fmt: skip
    return tr.train(tr.parse_args(argv))


@pytest.fixture(scope="module")
def planted_run(synthetic, tmp_path_factory):
    out = tmp_path_factory.mktemp("planted") / "policy.kvp.bin"
    return out, run_training(synthetic[0], out, "--steps", "150")


# --- trace reader -------------------------------------------------------------------------------------------------


def test_trace_reader_round_trips_synthetic_traces(synthetic):
    root, truth = synthetic
    traces = TraceSet(root)
    assert traces.identity() == {"arch": "synthetic", "n_layer": 2, "n_head_kv": 2, "head_dim_k": 8, "head_dim_v": 8,
                                 "n_ctx_train": 192}  # fmt: skip
    assert [s.split for s in traces.sequences] == truth.splits
    heldout = [i for i, split in enumerate(truth.splits) if split == "heldout"]
    assert traces.sequence_indices("heldout") == heldout and heldout
    samples = list(traces.samples("heldout"))
    assert len(samples) == len(heldout) * 3 * 2  # cuts x layers
    for sample in samples:
        seq, cut, layer = sample.sequence_id, sample.cut, sample.layer
        np.testing.assert_array_equal(sample.k, truth.keys[seq][layer, :cut].transpose(1, 0, 2).astype(np.float32))
        np.testing.assert_array_equal(sample.v, truth.values[seq][layer, :cut].transpose(1, 0, 2).astype(np.float32))
        np.testing.assert_array_equal(sample.importance, truth.importance[seq][cut][layer])
        np.testing.assert_array_equal(sample.positions, np.arange(cut))
        assert sample.k.dtype == np.float32 and sample.k.shape == (2, cut, 8)
    # the planted structure: log importance is linear in q · k
    sample = samples[0]
    logits = sample.k[0].astype(np.float64) @ truth.queries[sample.layer, 0]
    assert np.corrcoef(np.log(sample.importance[0]), logits)[0, 1] > 0.9999


def test_trace_reader_rejects_a_truncated_sequence(tmp_path):
    write_synthetic_traces(tmp_path, n_sequences=2)
    with open(tmp_path / "seq_00001" / "importance.f32", "r+b") as f:
        f.truncate(100)
    traces = TraceSet(tmp_path)
    traces.read(0, 64, 1)
    with pytest.raises(TraceFormatError, match="importance.f32 is 100 bytes"):
        traces.read(1, 64, 0)


# --- Plackett–Luce, reward, RLOO against brute force ------------------------------------------------------------


def all_rankings(n, n_agents):
    perms = torch.tensor(list(itertools.permutations(range(n))))
    return perms.unsqueeze(1).expand(-1, n_agents, -1).contiguous()  # (n!, A, n)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_plackett_luce_log_prob_is_the_product_formula_and_normalised(n):
    scores = torch.randn(2, n, generator=torch.Generator().manual_seed(n), dtype=torch.float64) * 2
    rankings = all_rankings(n, 2)
    log_probs = rl.plackett_luce_log_prob(scores, rankings)
    for agent in range(2):
        for perm, log_prob in zip(rankings[:, agent].tolist(), log_probs[:, agent].tolist()):
            s = scores[agent].tolist()
            product = 1.0
            for r in range(n):
                product *= math.exp(s[perm[r]]) / sum(math.exp(s[t]) for t in perm[r:])
            assert log_prob == pytest.approx(math.log(product), abs=1e-12)
    torch.testing.assert_close(log_probs.exp().sum(0), torch.ones(2, dtype=torch.float64))


def test_gumbel_sort_samples_the_plackett_luce_distribution():
    scores = torch.tensor([[1.0, 0.0, -0.5]], dtype=torch.float64)
    rankings = rl.gumbel_rankings(scores, 40000, torch.Generator().manual_seed(0))
    expected = rl.plackett_luce_log_prob(scores, all_rankings(3, 1)).exp()[:, 0]
    for perm, probability in zip(itertools.permutations(range(3)), expected.tolist()):
        frequency = (rankings[:, 0] == torch.tensor(perm)).all(-1).double().mean().item()
        assert frequency == pytest.approx(probability, abs=0.01)


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_cost_is_evicted_importance_over_all_budgets_and_oracle_is_minimal(n):
    importance = torch.rand(3, n, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    importance[2] = 0.0
    importance[2, 1] = 1.0  # one important token: the optimal cost is 0
    rankings = all_rankings(n, 3)
    costs = rl.ranking_cost(importance, rankings)
    for agent in range(3):
        for perm, cost in zip(rankings[:, agent].tolist(), costs[:, agent].tolist()):
            evicted = sum(importance[agent, perm[budget:]].sum().item() for budget in range(1, n))
            assert cost == pytest.approx(evicted, abs=1e-12)
    torch.testing.assert_close(rl.oracle_cost(importance), costs.min(0).values)
    rewards = rl.normalised_rewards(importance, rankings)
    torch.testing.assert_close(rewards[:, :2].max(0).values, -torch.ones(2, dtype=torch.float64))
    assert (rewards[:, :2] <= -1 + 1e-12).all()
    assert (rewards[:, 2] == 0).all()  # C(σ*) = 0: no reward signal


def test_rloo_advantage_leaves_one_out():
    rewards = torch.tensor([[[-1.0, -2.0], [-3.0, -2.0], [-2.0, -5.0], [-6.0, -3.0]]])  # (B=1, K=4, A=2)
    advantages = rl.rloo_advantages(rewards)
    for k in range(4):
        others = torch.cat([rewards[0, :k], rewards[0, k + 1 :]])
        torch.testing.assert_close(advantages[0, k], rewards[0, k] - others.mean(0))


def test_policy_gradient_raises_the_scores_of_important_tokens():
    # From equal scores, by symmetry, the expected ascent direction of token i is affine in I_i with a positive
    # slope: tokens more important than average go up, the others down.
    scores = torch.zeros(1, 4, requires_grad=True)
    importance = torch.tensor([[0.1, 4.0, 0.5, 2.0]])
    rankings = rl.gumbel_rankings(scores, 1024, torch.Generator().manual_seed(1))
    loss = rl.policy_gradient_loss(rl.plackett_luce_log_prob(scores, rankings)[None],
                                   rl.normalised_rewards(importance, rankings)[None])  # fmt: skip
    loss.backward()
    ascent = -scores.grad[0]
    assert torch.equal(torch.argsort(ascent), torch.argsort(importance[0]))
    assert ascent[3] > 0 > ascent[2]


def test_per_agent_gradient_clipping_leaves_other_agents_alone():
    weight = torch.zeros(2, 3, 4, requires_grad=True)
    bias = torch.zeros(2, 1, 4, requires_grad=True)
    weight.grad = torch.ones(2, 3, 4)
    weight.grad[0] *= 10.0
    bias.grad = torch.zeros(2, 1, 4)
    norms = rl.clip_grad_norm_per_agent_([weight, bias], 5.0)
    torch.testing.assert_close(norms, torch.tensor([10.0 * math.sqrt(12), math.sqrt(12)]))
    assert weight.grad[0].norm().item() == pytest.approx(5.0, rel=1e-5)
    torch.testing.assert_close(weight.grad[1], torch.ones(3, 4))


# --- evaluation -----------------------------------------------------------------------------------------------------


def test_evicted_importance_per_budget():
    importance = np.array([[1.0, 5.0, 2.0, 0.5, 3.0]])
    scores = np.array([[0.0, 4.0, 1.0, 3.0, 2.0]])  # keeps 1, 3, 4, 2, 0 in that order
    evicted = ev.evicted_importance(importance, scores, [0.2, 0.4, 0.6, 0.8, 0.0, 1.0])
    np.testing.assert_allclose(evicted[0], [6.5, 6.0, 3.0, 1.0, 11.5, 0.0])


def test_baselines_only_evaluation_has_oracle_at_one(synthetic):
    result = ev.evaluate(TraceSet(synthetic[0]))
    assert result["methods"] == ["random", "streaming", "knorm", "keydiff", "lagkv", "oracle"]
    assert result["per_head"]["oracle"]["mean"] == [1.0] * len(ev.BUDGETS)
    for method in ("random", "streaming", "knorm"):
        assert result["per_head"][method]["mean_over_budgets"] > 3.0
    for method in ("keydiff", "lagkv"):  # the runtime's policies through the ranking view: worse than the oracle
        assert np.isfinite(result["per_head"][method]["mean_over_budgets"])
        assert result["per_head"][method]["mean_over_budgets"] > 1.0
    assert np.array(result["per_head"]["random"]["cost"]).shape == (2, 2, len(ev.BUDGETS))
    assert result["per_head"]["oracle"]["reward"] == -1.0  # the RL reward of the optimal ranking
    assert all(result["per_head"][method]["reward"] < -1.0 for method in result["methods"][:-1])


def test_ranking_reward_is_the_rl_trainers_reward_of_the_greedy_ranking():
    rng = np.random.default_rng(3)
    importance = rng.exponential(size=(4, 50)) * (rng.random((4, 50)) < 0.3)
    importance[3] = 0.0
    importance[3, 7] = 1.0  # one token with importance: C(σ*) = 0, the reward undefined
    scores = rng.normal(size=(4, 50))
    order = torch.from_numpy(np.argsort(-scores, axis=-1, kind="stable"))
    expected = rl.normalised_rewards(torch.from_numpy(importance), order).numpy()
    got = ev.ranking_reward(importance, scores)
    np.testing.assert_allclose(got[:3], expected[:3], rtol=1e-12)
    assert np.isnan(got[3]) and expected[3] == 0.0


def test_min_cut_keeps_only_the_longer_prefixes(synthetic):
    traces = TraceSet(synthetic[0])
    cuts = sorted(cut for _, cut in traces.prefixes("heldout"))
    longer = ev.evaluate(traces, min_cut=cuts[-1])
    assert longer["prefix_lengths"] == [cut for cut in cuts if cut >= cuts[-1]]
    assert ev.evaluate(traces)["prefix_lengths"] == [cut for _, cut in traces.prefixes("heldout")]
    with pytest.raises(ValueError, match="nothing to evaluate"):
        ev.evaluate(traces, min_cut=cuts[-1] + 1)


def test_ranking_view_baselines_score_as_the_runtime_policy(synthetic):
    """keydiff in the evaluation is the engine's policy: its scores are the cosine similarity to the mean unit key
    of the cached tokens, negated (docs/policies.md), recomputed here in float64."""
    traces = TraceSet(synthetic[0])
    index, cut = traces.prefixes("heldout")[0]
    (trace,) = traces.read_prefix(index, cut, [1])
    scores = ev.baseline_scores("keydiff", trace, np.random.default_rng(0), traces.identity(), 4, 16)
    assert scores.shape == trace.importance.shape
    k = trace.k.astype(np.float64)  # (H, cut, d): the anchor is the mean over every cached key
    unit = k / np.linalg.norm(k, axis=-1, keepdims=True)
    mean = unit.mean(axis=1, keepdims=True)
    expected = -(unit * (mean / np.linalg.norm(mean, axis=-1, keepdims=True))).sum(-1)
    np.testing.assert_allclose(scores[:, 4 : cut - 16], expected[:, 4 : cut - 16], rtol=1e-4, atol=1e-5)


def test_input_statistics_are_the_training_inputs_mean_and_inverse_std(synthetic):
    root, truth = synthetic
    traces = TraceSet(root)
    features = pf.default_pos_features(traces.n_ctx_train)
    shift, scale = tr.input_statistics(traces, [1], features, n_sink=4, max_tokens=10**6)
    inputs = []
    for index in traces.sequence_indices("train"):
        end = max(traces.sequences[index].cuts)
        k = truth.keys[index][1, 4:end].astype(np.float64)  # (T, H, d)
        v = truth.values[index][1, 4:end].astype(np.float64)
        pos = np.broadcast_to(pf.pos_features(features, np.arange(4, end))[:, None, :], (end - 4, 2, len(features)))
        inputs.append(np.concatenate([k, v, pos], axis=-1))
    inputs = np.concatenate(inputs)  # (tokens, H, D)
    np.testing.assert_allclose(shift, inputs.mean(axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(scale, 1.0 / inputs.std(axis=0), rtol=1e-4)


def test_learning_rate_schedule_warms_up_then_decays_to_the_floor():
    factor = tr.warmup_cosine(warmup=10, steps=110, lr=1e-3, min_lr=1e-6)
    assert factor(0) == pytest.approx(0.01)
    assert factor(5) == pytest.approx(0.505)
    assert factor(10) == pytest.approx(1.0)
    assert factor(60) == pytest.approx((1.0 + 1e-3) / 2)
    assert factor(110) == pytest.approx(1e-3)


# --- training runs ----------------------------------------------------------------------------------------------


def test_rl_training_learns_the_planted_ranking(planted_run):
    out, result = planted_run
    per_head = result.evaluation["per_head"]
    kvp, random = per_head["kvp"]["mean_over_budgets"], per_head["random"]["mean_over_budgets"]
    assert random > 5.0
    assert kvp - 1.0 < 0.05 * (random - 1.0), (kvp, random)
    shared = result.evaluation["shared"]
    assert shared["kvp"]["mean_over_budgets"] < 1.3 * shared["oracle"]["mean_over_budgets"]
    written = pf.read_policy(out)
    assert written.metadata["steps"] == 150 and written.metadata["objective"] == "rl"
    assert written.metadata["heldout"]["per_head"]["kvp"]["mean_over_budgets"] == pytest.approx(kvp)
    assert "wall_time_s" not in written.metadata  # --reproducible


def test_supervised_baseline_learns_the_planted_ranking(synthetic, tmp_path):
    result = run_training(synthetic[0], tmp_path / "sup.kvp.bin", "--objective", "supervised", "--steps", "60")
    per_head = result.evaluation["per_head"]
    assert per_head["kvp"]["mean_over_budgets"] - 1.0 < 0.05 * (per_head["random"]["mean_over_budgets"] - 1.0)
    assert pf.read_policy(tmp_path / "sup.kvp.bin").metadata["objective"] == "supervised"


def test_listwise_objective_learns_the_planted_ranking(synthetic, tmp_path):
    result = run_training(synthetic[0], tmp_path / "list.kvp.bin", "--objective", "listwise", "--steps", "60")
    per_head = result.evaluation["per_head"]
    assert per_head["kvp"]["mean_over_budgets"] - 1.0 < 0.05 * (per_head["random"]["mean_over_budgets"] - 1.0)
    assert pf.read_policy(tmp_path / "list.kvp.bin").metadata["objective"] == "listwise"


def test_listwise_loss_is_the_kl_divergence_from_the_importance_distribution():
    torch.manual_seed(0)
    scores = torch.randn(3, 7, dtype=torch.float64)
    importance = torch.rand(3, 7, dtype=torch.float64)
    importance[1, 2] = 0.0  # a token nobody attends to
    expected = 0.0
    for a in range(3):
        p = importance[a].numpy() / importance[a].numpy().sum()
        q = np.exp(scores[a].numpy()) / np.exp(scores[a].numpy()).sum()
        expected += sum(pi * math.log(pi / qi) for pi, qi in zip(p, q) if pi > 0)
    assert rl.listwise_kl_loss(scores, importance).item() == pytest.approx(expected, rel=1e-12)
    # zero exactly when softmax(scores) is the importance distribution, whatever the offset
    matched = torch.log(importance + 1e-300) + 5.0
    assert rl.listwise_kl_loss(matched[:1], importance[:1]).item() == pytest.approx(0.0, abs=1e-12)


def test_softrank_objective_learns_the_planted_ranking(synthetic, tmp_path):
    result = run_training(synthetic[0], tmp_path / "soft.kvp.bin", "--objective", "softrank", "--steps", "60")
    per_head = result.evaluation["per_head"]
    assert per_head["kvp"]["mean_over_budgets"] - 1.0 < 0.05 * (per_head["random"]["mean_over_budgets"] - 1.0)
    written = pf.read_policy(tmp_path / "soft.kvp.bin").metadata
    assert written["objective"] == "softrank" and written["hyperparameters"]["anchors"] == 128
    assert written["hyperparameters"]["rank_temperature"] == 0.02
    # --listwise-weight adds the listwise loss: another run, which also learns the ranking
    mixed = run_training(synthetic[0], tmp_path / "mixed.kvp.bin", "--objective", "softrank", "--steps", "60",
                         "--listwise-weight", "1")
    mixed_cost = mixed.evaluation["per_head"]["kvp"]["mean_over_budgets"]
    assert mixed_cost - 1.0 < 0.05 * (per_head["random"]["mean_over_budgets"] - 1.0)
    assert mixed_cost != per_head["kvp"]["mean_over_budgets"]
    assert pf.read_policy(tmp_path / "mixed.kvp.bin").metadata["hyperparameters"]["listwise_weight"] == 1.0


def _sigmoid(z):
    return 1 / (1 + math.exp(-z)) if z >= 0 else math.exp(z) / (1 + math.exp(z))


def _soft_rank_cost_brute_force(scores, importance):
    """Σ over agents of Σ_i I_i Σ_{j≠i} sigmoid(s_j − s_i) / C(σ*), C(σ*) from the sorted importance; 0 where C* = 0."""
    total = 0.0
    for s, imp in zip(scores.tolist(), importance.tolist()):
        best = sum(r * x for r, x in enumerate(sorted(imp, reverse=True)))
        if best == 0:
            continue
        cost = sum(imp[i] * sum(_sigmoid(s[j] - s[i]) for j in range(len(s)) if j != i)
                   for i in range(len(s)))
        total += cost / best
    return total


def test_soft_rank_cost_estimates_the_smoothed_cost_and_tends_to_the_rl_cost_of_the_ranking_by_score():
    torch.manual_seed(0)
    scores = torch.randn(3, 6, dtype=torch.float64)
    importance = torch.rand(3, 6, dtype=torch.float64)
    importance[2] = 0.0
    importance[2, 1] = 0.7  # one attended token: C* = 0, no defined cost
    generator = torch.Generator().manual_seed(1)
    estimate = rl.soft_rank_cost_loss(scores, importance, 200_000, generator).item()
    exact = _soft_rank_cost_brute_force(scores, importance)
    assert estimate == pytest.approx(exact, rel=5e-3)
    assert rl.soft_rank_cost_loss(scores[2:], importance[2:], 8, generator).item() == 0.0
    # with widely spaced scores every sigmoid is 0 or 1: the cost of the ranking by score, −R of normalised_rewards
    sharp = scores[:2] * 1e4
    by_score = torch.argsort(sharp, dim=-1, descending=True).unsqueeze(0)
    rl_cost = -rl.normalised_rewards(importance[:2], by_score).sum().item()
    assert _soft_rank_cost_brute_force(sharp, importance[:2]) == pytest.approx(rl_cost, rel=1e-9)
    assert rl.soft_rank_cost_loss(sharp, importance[:2], 200_000, generator).item() == pytest.approx(rl_cost, rel=5e-3)
    # a temperature t is the same as scores divided by t (the same anchors for the same generator state)
    cooled = rl.soft_rank_cost_loss(scores, importance, 64, torch.Generator().manual_seed(2), temperature=0.25)
    scaled = rl.soft_rank_cost_loss(scores / 0.25, importance, 64, torch.Generator().manual_seed(2))
    assert cooled.item() == pytest.approx(scaled.item(), rel=1e-12)
    assert cooled.item() != pytest.approx(rl.soft_rank_cost_loss(scores, importance, 64,
                                                                 torch.Generator().manual_seed(2)).item(), rel=1e-3)


def test_soft_rank_cost_gradient_orders_two_tokens_by_importance():
    scores = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    importance = torch.tensor([[0.1, 0.6, 0.3]], dtype=torch.float64)
    rl.soft_rank_cost_loss(scores, importance, 50_000, torch.Generator().manual_seed(0)).backward()
    # descending the gradient raises the most important token and lowers the least important one
    assert scores.grad[0, 1] < 0 < scores.grad[0, 0]


def test_exported_policy_scores_match_the_torch_model(planted_run, synthetic):
    out, result = planted_run
    trainer = result.trainer
    scorer = kvp_cpp.Scorer(kvp_cpp.load_policy(str(out)), kernel="auto", n_threads=1)
    traces = TraceSet(synthetic[0])
    index, cut = traces.prefixes("heldout")[0]
    inputs, _, _, _ = trainer.prefix_tensors(index, cut)
    with torch.no_grad():
        expected = trainer.model(inputs).numpy()  # (L·H, c)
    for slot, layer in enumerate(trainer.layers):
        trace = traces.read(index, cut, layer)
        scores = scorer.score_layer(layer, trace.k.transpose(1, 0, 2).copy(), trace.v.transpose(1, 0, 2).copy(),
                                    trace.positions)  # fmt: skip
        reference = expected[slot * traces.n_head_kv : (slot + 1) * traces.n_head_kv].T
        np.testing.assert_allclose(scores, reference, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(reference).max())))


# --- the recency term ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def recency_traces(tmp_path_factory):
    """Synthetic traces whose importance depends on a token's age alone, peaking at age 32 (exp(−2 (log2 age − 5)²))
    at every cut: no score of the token itself (the MLP sees its key, value and absolute position) ranks it at every
    cut, a recency term can."""
    root = tmp_path_factory.mktemp("recency_traces")
    write_synthetic_traces(root, seed=5)
    traces = TraceSet(root)
    for info in traces.sequences:
        parts = [np.broadcast_to(np.exp(-2.0 * (np.log2(cut - np.arange(cut)) - 5.0) ** 2),
                                 (traces.n_layer, traces.n_head_kv, cut)) for cut in info.cuts]  # fmt: skip
        np.concatenate([part.reshape(-1) for part in parts]).astype("<f4").tofile(
            os.path.join(root, info.dir, "importance.f32"))
    return str(root)


@pytest.mark.parametrize("knots", [1, 2, 5, 14])
def test_torch_recency_term_is_the_file_formula(knots):
    generator = torch.Generator().manual_seed(0)
    model = rl.AgentStack(4, 3, [2], "relu", np.zeros((4, 3)), np.ones((4, 3)), generator, recency_knots=knots)
    with torch.no_grad():
        model.recency.copy_(torch.randn(4, knots, generator=generator))
    data = pf.random_policy(n_layer=2, n_head_kv=2, head_dim_k=1, head_dim_v=1, n_ctx_train=64, hidden=(2,))
    data.recency = {(layer, head): model.recency[layer * 2 + head].detach().numpy().copy()
                    for layer in range(2) for head in range(2)}  # fmt: skip
    ages = np.array([1, 2, 3, 5, 16, 17, 100, 1000, 9000, 1 << 33], dtype=np.int64)
    with torch.no_grad():
        terms = model.recency_term(torch.from_numpy(ages)).numpy()  # (A, T)
    expected = np.concatenate([pf.recency_terms(data, layer, ages).T for layer in range(2)])
    np.testing.assert_allclose(terms, expected, rtol=1e-6, atol=1e-6)


def test_recency_term_learns_what_no_token_score_can(recency_traces, tmp_path):
    options = ("--objective", "listwise", "--steps", "150", "--lr", "5e-2")
    without = run_training(recency_traces, tmp_path / "plain.kvp.bin", *options)
    with_terms = run_training(recency_traces, tmp_path / "recency.kvp.bin", *options, "--recency-knots", "8")
    cost = lambda result: result.evaluation["per_head"]["kvp"]["mean_over_budgets"]  # noqa: E731
    assert cost(with_terms) < 1.03 < 1.15 < cost(without)
    data = pf.read_policy(tmp_path / "recency.kvp.bin")
    assert data.n_recency_knots == 8 and data.metadata["hyperparameters"]["recency_knots"] == 8
    assert pf.read_policy(tmp_path / "plain.kvp.bin").recency == {}
    for values in data.recency.values():  # ranked ages are 17 … 124: the knot at 32 must be the peak
        assert values[4] < values[5] > values[6] > values[7]


@pytest.fixture
def two_sources(synthetic, tmp_path):
    """The synthetic traces with their sequences split between two sources: "first" (ids 0-3) and "second"."""
    import shutil

    root = tmp_path / "two_sources"
    shutil.copytree(synthetic[0], root)
    with open(root / "manifest.json", encoding="utf-8") as f:
        manifest = json.load(f)
    for entry in manifest["sequences"]:
        entry["source"] = "first" if entry["id"] < 4 else "second"
    with open(root / "manifest.json", "w", encoding="utf-8") as f:
        json.dump(manifest, f)
    return str(root)


def test_sources_restrict_training_statistics_and_evaluation(two_sources, tmp_path):
    traces = TraceSet(two_sources)
    second = [i for i in traces.sequence_indices("train") if traces.sequences[i].source == "second"]
    assert second and len(second) < len(traces.sequence_indices("train"))
    assert traces.sequences_of("train", ["second"]) == second
    assert traces.sequences_of("train", None) == traces.sequence_indices("train")
    with pytest.raises(ValueError, match="has the sources first,second"):
        traces.sequences_of("train", ["chats"])
    with pytest.raises(ValueError, match="has the sources first,second"):
        traces.sequences_of("train", [])

    features = pf.default_pos_features(traces.n_ctx_train)
    everything = tr.input_statistics(traces, [1], features, n_sink=4, max_tokens=10**6)
    only_second = tr.input_statistics(traces, [1], features, n_sink=4, max_tokens=10**6, sequences=second)
    assert not np.allclose(everything[0], only_second[0])
    k = np.concatenate([traces.keys(i)[1, 4 : max(traces.sequences[i].cuts)].astype(np.float64) for i in second])
    np.testing.assert_allclose(only_second[0][:, : k.shape[-1]], k.mean(axis=0), rtol=1e-5, atol=1e-6)

    trainer = tr.Trainer(traces, tr.parse_args(["--traces", two_sources, "--out", str(tmp_path / "p.kvp.bin"),
                                                "--sources", "second", "--hidden", "8"]))  # fmt: skip
    sampled = {index for _ in range(50) for index, _ in trainer.sample_prefixes()}
    assert sampled <= set(second)
    result = run_training(two_sources, tmp_path / "second.kvp.bin", "--sources", "second", "--steps", "5")
    assert pf.read_policy(tmp_path / "second.kvp.bin").metadata["data"]["train_sequences"] == len(second)
    assert result.trainer.args.sources == ["second"]

    heldout_first = [cut for i, cut in traces.prefixes("heldout") if traces.sequences[i].source == "first"]
    assert ev.evaluate(traces, sources=["first"])["prefix_lengths"] == heldout_first
    with pytest.raises(ValueError, match="sources text"):
        ev.evaluate(traces, sources=["text"])


def test_same_seed_same_bytes_other_seed_other_bytes(synthetic, tmp_path):
    for name, seed in (("a", "0"), ("b", "0"), ("c", "1")):
        run_training(synthetic[0], tmp_path / f"{name}.kvp.bin", "--steps", "12", "--seed", seed)
    a, b, c = ((tmp_path / f"{name}.kvp.bin").read_bytes() for name in "abc")
    assert a == b
    assert a != c


def test_resume_equals_an_uninterrupted_run(synthetic, tmp_path):
    steps = ["--steps", "16", "--checkpoint-every", "5"]
    run_training(synthetic[0], tmp_path / "full.kvp.bin", *steps)
    stopped = run_training(synthetic[0], tmp_path / "split.kvp.bin", *steps, "--stop-at", "8")
    assert stopped.policy is None and not (tmp_path / "split.kvp.bin").exists()
    resumed = run_training(synthetic[0], tmp_path / "split.kvp.bin", *steps, "--resume")
    assert resumed.trainer.step == 16
    assert (tmp_path / "split.kvp.bin").read_bytes() == (tmp_path / "full.kvp.bin").read_bytes()
    with pytest.raises(ValueError, match="another run"):
        run_training(synthetic[0], tmp_path / "split.kvp.bin", "--steps", "16", "--seed", "5", "--resume")


def test_init_starts_from_a_trained_policy_and_rejects_one_of_another_shape(synthetic, tmp_path):
    knots = ["--recency-knots", "4"]
    first = run_training(synthetic[0], tmp_path / "first.kvp.bin", "--objective", "listwise", "--steps", "12", *knots)
    still = ["--objective", "rl", "--steps", "1", "--lr", "1e-12", "--min-lr", "1e-12", "--weight-decay", "0", *knots]
    again = run_training(synthetic[0], tmp_path / "again.kvp.bin", *still, "--init", str(tmp_path / "first.kvp.bin"))
    fresh = run_training(synthetic[0], tmp_path / "fresh.kvp.bin", *still)

    def arrays(policy, key):
        agent = policy.agents[key]
        return [agent.shift, agent.scale, *agent.weights, *agent.biases, policy.recency[key]]

    for key in first.policy.agents:
        for trained, started in zip(arrays(first.policy, key), arrays(again.policy, key)):
            np.testing.assert_allclose(started, trained, rtol=0, atol=1e-9)
    assert not all(np.allclose(a, b) for a, b in zip(arrays(first.policy, key), arrays(fresh.policy, key)))
    with pytest.raises(ValueError, match="hidden"):
        run_training(synthetic[0], tmp_path / "x.kvp.bin", *still, "--hidden", "8",
                     "--init", str(tmp_path / "first.kvp.bin"))
    with pytest.raises(ValueError, match="n_recency_knots"):
        run_training(synthetic[0], tmp_path / "x.kvp.bin", *still[:-2], "--init", str(tmp_path / "first.kvp.bin"))
    shipped = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models",
                           "smollm2-135m-instruct.kvp.bin")
    with pytest.raises(ValueError, match="--init .*policy identity"):  # a policy of another model
        run_training(synthetic[0], tmp_path / "x.kvp.bin", *still, "--init", shipped)


def test_resume_with_recency_terms_and_from_a_checkpoint_older_than_them(synthetic, tmp_path):
    steps = ["--steps", "12", "--checkpoint-every", "4", "--recency-knots", "4"]
    run_training(synthetic[0], tmp_path / "full.kvp.bin", *steps)
    run_training(synthetic[0], tmp_path / "split.kvp.bin", *steps, "--stop-at", "8")
    run_training(synthetic[0], tmp_path / "split.kvp.bin", *steps, "--resume")
    assert (tmp_path / "split.kvp.bin").read_bytes() == (tmp_path / "full.kvp.bin").read_bytes()
    assert pf.read_policy(tmp_path / "full.kvp.bin").n_recency_knots == 4
    # a checkpoint written before --recency-knots (and the softrank options) existed is a run without recency terms
    plain = ["--steps", "12", "--checkpoint-every", "4"]
    run_training(synthetic[0], tmp_path / "plain.kvp.bin", *plain)
    run_training(synthetic[0], tmp_path / "old.kvp.bin", *plain, "--stop-at", "8")
    checkpoint = str(tmp_path / "old.kvp.bin.ckpt")
    state = torch.load(checkpoint, weights_only=True)
    for key in ("recency_knots", "anchors", "rank_temperature", "listwise_weight"):
        del state["config"][key]
    torch.save(state, checkpoint)
    run_training(synthetic[0], tmp_path / "old.kvp.bin", *plain, "--resume")
    assert (tmp_path / "old.kvp.bin").read_bytes() == (tmp_path / "plain.kvp.bin").read_bytes()


def test_pipeline_runs_every_step_on_a_tiny_corpus_and_resumes(tmp_path):
    """training.pipeline end to end on the default model: 5 prose documents of 256 tokens (the 5th held out)."""
    from training import pipeline

    out = tmp_path / "run"
    args = ["--out", str(out), "--ruler", "0", "--chats", "0", "--text", "5", "--length", "256", "--steps", "3",
            "--hidden", "4", "-t", "2", "--install", str(tmp_path / "models" / "tiny.kvp.bin")]
    assert pipeline.main(args) == 0
    record = json.loads((out / "pipeline.json").read_text())
    assert set(record["seconds"]) == {"traces", "train", "onnx"}
    assert set(record["heldout_mean_cost"]["per_head"]) >= {"kvp", "streaming", "keydiff", "oracle"}
    assert record["heldout_mean_cost"]["per_head"]["oracle"] == 1.0
    installed = (tmp_path / "models" / "tiny.kvp.bin").read_bytes()
    assert installed == (out / "policy.kvp.bin").read_bytes()
    assert pipeline.same_policy(str(out / "policy.kvp.bin"), str(out / "policy.from_onnx.kvp.bin"))
    data = pf.read_policy(out / "policy.kvp.bin")
    assert data.n_recency_knots == 14  # the shipped recipe's recency terms, through the ONNX round trip too
    data.recency = {key: values + 1.0 for key, values in data.recency.items()}
    pf.write_policy(tmp_path / "other.kvp.bin", data)
    assert not pipeline.same_policy(str(out / "policy.kvp.bin"), str(tmp_path / "other.kvp.bin"))
    trained = record["seconds"]["train"]
    assert pipeline.main(args) == 0  # a rerun skips the finished steps
    assert json.loads((out / "pipeline.json").read_text())["seconds"]["train"] == trained
    assert (out / "policy.kvp.bin").read_bytes() == installed


def test_pipeline_calibrates_an_rl_policy_keeping_each_heads_order(tmp_path):
    """--objective rl: train, then per-agent temperatures; the per-head held-out cost is the uncalibrated one."""
    from training import pipeline

    out = tmp_path / "run"
    args = ["--out", str(out), "--ruler", "0", "--chats", "0", "--text", "5", "--length", "256", "--steps", "3",
            "--hidden", "4", "-t", "2", "--objective", "rl", "--recency-knots", "0", "--calibration-prefixes", "4"]
    assert pipeline.main(args) == 0
    record = json.loads((out / "pipeline.json").read_text())
    assert set(record["seconds"]) == {"traces", "train", "calibrate", "onnx"}
    raw, tuned = pf.read_policy(out / "policy.uncalibrated.kvp.bin"), pf.read_policy(out / "policy.kvp.bin")
    assert "calibration" in tuned.metadata and "calibration" not in raw.metadata
    assert any(not np.array_equal(raw.agents[a].weights[-1], tuned.agents[a].weights[-1]) for a in raw.agents)
    before = json.loads((out / "heldout.uncalibrated.json").read_text())
    after = json.loads((out / "heldout.json").read_text())
    assert after["per_head"]["kvp"]["mean_over_budgets"] == pytest.approx(
        before["per_head"]["kvp"]["mean_over_budgets"], rel=1e-6)
    assert record["heldout_mean_cost"]["shared"]["kvp"] == after["shared"]["kvp"]["mean_over_budgets"]
    assert pipeline.same_policy(str(out / "policy.kvp.bin"), str(out / "policy.from_onnx.kvp.bin"))


# --- trace capture: cut points ------------------------------------------------------------------------------------


def test_random_cuts_have_n_future_queries_and_anchored_cuts_the_rest_of_the_sequence():
    import random

    from training.capture_traces import choose_cuts

    cuts = choose_cuts(1000, 64, 3, random.Random("doc"), anchored=(900, 950, 1000, 0))
    assert list(cuts) == sorted(cuts)
    assert cuts[936] == 64  # the last full window
    assert cuts[900] == 100 and cuts[950] == 50
    assert 1000 not in cuts and 0 not in cuts  # an anchor with no future, or no cache, is no cut
    assert all(cut + future <= 1000 for cut, future in cuts.items())
    randoms = [cut for cut in cuts if cut not in (900, 936, 950)]
    assert randoms and all(128 <= cut <= 936 and cuts[cut] == 64 for cut in randoms)
    assert cuts == choose_cuts(1000, 64, 3, random.Random("doc"), anchored=(900, 950))  # seeded per document


def test_ruler_documents_anchor_cuts_at_the_question_and_at_the_answer():
    from training.capture_traces import ruler_documents

    llm = kvp_cpp.Llama(kvp_cpp.default_model_path(), n_ctx=64, vocab_only=True, verbose=False)
    (kind, name, text, anchors), = list(ruler_documents(kvp_cpp.default_model_path(), 1, 512, seed=0))
    assert kind == "ruler" and name.startswith("niah_single_1/")
    question_at, answer_at = anchors
    assert text[question_at:].lstrip().startswith("What is the special magic number")
    assert text[answer_at:].startswith(" The special magic number")  # the answer prefix, after the prompt
    tokens = llm.tokenize(text.encode(), add_bos=True, special=True)
    cut = len(llm.tokenize(text[:question_at].encode(), add_bos=True, special=True))
    assert llm.detokenize(tokens[cut:]).decode().lstrip().startswith("What is the special magic number")


def test_trace_reader_takes_a_future_per_cut_and_rejects_one_that_does_not_fit(tmp_path):
    write_synthetic_traces(tmp_path, n_sequences=2, n_tokens=192, cuts=(64, 96, 128), n_future=32)
    manifest_path = tmp_path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["sequences"][0]["futures"] = [32, 96, 64]  # the last two run to the end of the sequence
    manifest_path.write_text(json.dumps(manifest))
    assert TraceSet(tmp_path).sequences[0].futures == (32, 96, 64)
    assert TraceSet(tmp_path).sequences[1].futures == (32, 32, 32)  # none given: n_future each
    manifest["sequences"][0]["futures"] = [32, 97, 64]
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(TraceFormatError, match="cut 96 with 97 future queries does not fit in its 192 tokens"):
        TraceSet(tmp_path)
    manifest["sequences"][0]["futures"] = [32, 32]
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(TraceFormatError, match="2 futures for 3 cuts"):
        TraceSet(tmp_path)


def test_sliding_window_traces_train_the_global_layers_past_the_window(tmp_path):
    """A model with sliding-window layers (Gemma 3): by default only the layers that attend to the whole context get
    agents, and the window, which the engine always keeps, is never ranked."""
    write_synthetic_traces(tmp_path, n_sequences=4, n_tokens=192, cuts=(64, 96, 128), n_layer=3, n_future=32)
    manifest_path = tmp_path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["model"].update(sliding_window=70, sliding_layers=[0, 1])
    manifest_path.write_text(json.dumps(manifest))
    traces = TraceSet(tmp_path)
    assert traces.sliding_window == 70 and traces.global_layers == [2]
    result = run_training(str(tmp_path), tmp_path / "p.kvp.bin", "--steps", "3")
    policy = pf.read_policy(str(tmp_path / "p.kvp.bin"))
    assert policy.layer_scored == [False, False, True] and policy.n_recent == 70
    assert result.trainer.train_sequences == [(0, [96, 128]), (1, [96, 128]), (2, [96, 128])]  # cuts > 4 + 70 + 1
    assert ev.evaluate(traces)["layers"] == [2] and ev.evaluate(traces)["n_recent"] == 70  # baselines: the same
    explicit = run_training(str(tmp_path), tmp_path / "q.kvp.bin", "--steps", "1", "--layers", "1,2",
                            "--n-recent", "16")
    assert explicit.trainer.layers == [1, 2] and pf.read_policy(str(tmp_path / "q.kvp.bin")).n_recent == 16


def test_a_chat_asked_again_from_its_seed_keeps_the_seeds_split():
    from training.capture_traces import SEED_CHATS, split_of

    n = len(SEED_CHATS)
    assert [split_of("chats", i) for i in range(10)] == ["train"] * 4 + ["heldout"] + ["train"] * 4 + ["heldout"]
    assert all(split_of("chats", n + i) == split_of("chats", i) for i in range(n))
    assert split_of("chats", n + 4) == "heldout" and split_of("text", n + 4) != split_of("chats", n + 4)
    assert [split_of("text", i) for i in (4, 9, 55)] == ["heldout", "heldout", "train"]


def test_a_base_model_without_chat_template_gets_plain_dialogues():
    from training.capture_traces import SEED_CHATS, chat_documents

    class BaseModel:  # what chat_documents asks of a llama_cpp.Llama without tokenizer.chat_template
        metadata = {}
        prompts = []

        def create_completion(self, prompt, *, max_tokens, temperature, seed, stop):
            assert stop == ["\nUser:"] and max_tokens == 160
            self.prompts.append(prompt)
            return {"choices": [{"text": f" reply {seed}.\n"}]}

    llm = BaseModel()
    (kind, name, text, anchors), = list(chat_documents(llm, 1, seed=5))
    assert (kind, name, anchors) == ("chats", "chat/0", ())
    messages = [m for first, rest in SEED_CHATS[:3] for m in (first, *rest)]  # three seed chats in a row
    expected = "".join(f"User: {m}\nAssistant: reply {5 + t}.\n" for t, m in enumerate(messages))
    assert text == expected
    assert llm.prompts[1] == f"User: {messages[0]}\nAssistant: reply 5.\nUser: {messages[1]}\nAssistant:"


def test_calibration_on_traces_undoes_a_planted_rescaling(synthetic, planted_run):
    from training import calibrate

    traces = TraceSet(synthetic[0])
    policy = pf.read_policy(planted_run[0])
    fitted = calibrate.fit_temperatures(traces, policy)
    shrunk = calibrate.calibrated(policy, {agent: 0.2 for agent in policy.agents})
    refitted = calibrate.fit_temperatures(traces, shrunk)
    step = calibrate.DEFAULT_GRID[1] / calibrate.DEFAULT_GRID[0]
    for agent, t in fitted.items():
        assert calibrate.DEFAULT_GRID[0] < t < calibrate.DEFAULT_GRID[-1]
        assert abs(np.log(refitted[agent] / (5.0 * t))) <= np.log(step) + 1e-9  # the same optimum, on a grid point
    with pytest.raises(ValueError, match="identity"):
        calibrate.fit_temperatures(traces, pf.read_policy(os.path.join(
            os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "smollm2-135m-instruct.kvp.bin")))
