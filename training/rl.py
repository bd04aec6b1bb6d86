"""The learning math of the eviction agents (KVP paper §3; docs/kvp-bin-format.md for the agent).

- AgentStack: the MLPs of many independent agents (every KV head of every trained layer), one batched tensor per
  dense layer, evaluated on x = (concat(k, v, position features) − shift) · scale exactly as the runtime does.
- Plackett–Luce policy over rankings of a prefix's rankable tokens: Gumbel-sort sampling and log π(σ).
- Reward: R(σ) = −C(σ)/C(σ*) with C(σ) = Σ_r (r−1)·I(σ_r), the importance evicted summed over every budget.
- RLOO policy-gradient loss, the supervised baseline's loss, and per-agent gradient clipping.

Tensors of many agents put the agent axis A first; sampled rankings are (K, A, n).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvp_cpp import policy_file as pf

__all__ = [
    "ACTIVATIONS",
    "AgentStack",
    "agent_inputs",
    "gumbel_rankings",
    "plackett_luce_log_prob",
    "ranking_cost",
    "oracle_cost",
    "normalised_rewards",
    "rloo_advantages",
    "policy_gradient_loss",
    "log_importance_regression_loss",
    "listwise_kl_loss",
    "soft_rank_cost_loss",
    "clip_grad_norm_per_agent_",
]

ACTIVATIONS = {
    "relu": F.relu,
    "silu": F.silu,
    "gelu_tanh": partial(F.gelu, approximate="tanh"),
    "tanh": torch.tanh,
}
assert tuple(ACTIVATIONS) == pf.ACTIVATIONS


class AgentStack(nn.Module):
    """n_agents independent MLPs input_dim → hidden… → 1 with the same shape, evaluated together.

    Weights are (A, n_in, n_out) and biases (A, 1, n_out), so a dense layer is one torch.baddbmm; agent a's kvp.bin
    weight W_j is weights[j][a].T. shift and scale (A, input_dim) are fixed buffers (the input normalisation).
    """

    def __init__(
        self,
        n_agents: int,
        input_dim: int,
        hidden: Sequence[int],
        activation: str,
        shift: np.ndarray,
        scale: np.ndarray,
        generator: torch.Generator,
        recency_knots: int = 0,
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not one of {tuple(ACTIVATIONS)}")
        self.input_dim = input_dim
        self.hidden = list(hidden)
        self.activation = activation
        self.register_buffer("shift", torch.tensor(np.asarray(shift, np.float32)).reshape(n_agents, 1, input_dim))
        self.register_buffer("scale", torch.tensor(np.asarray(scale, np.float32)).reshape(n_agents, 1, input_dim))
        self.weights = nn.ParameterList()
        self.biases = nn.ParameterList()
        widths = [input_dim, *self.hidden, 1]
        for n_in, n_out in zip(widths[:-1], widths[1:]):
            bound = 1.0 / math.sqrt(n_in)  # nn.Linear's default initialisation, drawn for every agent
            self.weights.append(nn.Parameter((torch.rand(n_agents, n_in, n_out, generator=generator) * 2 - 1) * bound))
            self.biases.append(nn.Parameter((torch.rand(n_agents, 1, n_out, generator=generator) * 2 - 1) * bound))
        # the learned recency term h(age) of every agent at ages 2^0 … 2^(K−1) (policy_file.recency_terms); zeros,
        # drawn from no generator, so a run without it keeps its random streams and bytes
        self.recency = nn.Parameter(torch.zeros(n_agents, recency_knots)) if recency_knots else None

    @property
    def n_agents(self) -> int:
        return self.shift.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Scores (A, T) of un-normalised inputs x (A, T, input_dim)."""
        h = (x - self.shift) * self.scale
        act = ACTIVATIONS[self.activation]
        last = len(self.weights) - 1
        for j, (w, b) in enumerate(zip(self.weights, self.biases)):
            h = torch.baddbmm(b, h, w)
            if j < last:
                h = act(h)
        return h.squeeze(-1)

    def recency_term(self, ages: torch.Tensor) -> torch.Tensor:
        """(A, T) recency terms for token ages (T,) ≥ 1: policy_file.recency_terms' interpolation, in torch."""
        knots = self.recency.shape[1]
        u = torch.log2(ages.to(torch.float64).clamp_min(1.0)).clamp(max=knots - 1)
        j = u.floor().clamp(max=max(knots - 2, 0)).long()
        t = (u - j).to(self.recency.dtype)
        upper = (j + 1).clamp(max=knots - 1)
        return (1 - t) * self.recency[:, j] + t * self.recency[:, upper]

    def export(self, agent: int) -> pf.Agent:
        """Agent `agent` in the layout of policy_file (weights (n_out, n_in), float32)."""
        with torch.no_grad():
            return pf.Agent(
                shift=self.shift[agent, 0].numpy().copy(),
                scale=self.scale[agent, 0].numpy().copy(),
                weights=[w[agent].T.contiguous().numpy().copy() for w in self.weights],
                biases=[b[agent, 0].numpy().copy() for b in self.biases],
            )


def agent_inputs(layer_traces: Sequence, features: np.ndarray) -> np.ndarray:
    """(L·H, c, dk+dv+P) float32 agent inputs of the layers of one prefix, agent index layer_slot·H + head.

    layer_traces: traces.LayerTrace of the same prefix; features: (c, P) position features of its tokens.
    """
    k = np.stack([t.k for t in layer_traces])  # (L, H, c, dk)
    v = np.stack([t.v for t in layer_traces])
    n_layer, n_head, n_tokens, _ = k.shape
    pos = np.broadcast_to(features.astype(np.float32), (n_layer, n_head, n_tokens, features.shape[1]))
    return np.concatenate([k, v, pos], axis=-1).reshape(n_layer * n_head, n_tokens, -1)


# --- Plackett–Luce policy ------------------------------------------------------------------------------------------


def gumbel_rankings(scores: torch.Tensor, n_samples: int, generator: torch.Generator) -> torch.Tensor:
    """K rankings (K, A, n) drawn from the Plackett–Luce distribution of scores (A, n): argsort of score + Gumbel
    noise, descending (rank 0 is kept longest)."""
    exponential = torch.empty((n_samples, *scores.shape), dtype=scores.dtype).exponential_(generator=generator)
    gumbel = -torch.log(exponential.clamp_min(torch.finfo(scores.dtype).tiny))
    perturbed = (scores.detach().unsqueeze(0) + gumbel).numpy()
    # numpy's (SIMD) argsort is several times faster than torch.sort on CPU; ties have probability zero.
    return torch.from_numpy(np.argsort(-perturbed, axis=-1))


def plackett_luce_log_prob(scores: torch.Tensor, rankings: torch.Tensor) -> torch.Tensor:
    """log π(σ) = Σ_r [s_σr − log Σ_{t≥r} exp s_σt] of rankings (K, A, n) under scores (A, n); returns (K, A)."""
    ordered = scores.expand_as(rankings).gather(-1, rankings)
    suffix_lse = torch.logcumsumexp(ordered.flip(-1), dim=-1).flip(-1)
    return (ordered - suffix_lse).sum(-1)


# --- reward --------------------------------------------------------------------------------------------------------


def ranking_cost(importance: torch.Tensor, rankings: torch.Tensor) -> torch.Tensor:
    """C(σ) = Σ_r (r−1)·I(σ_r) (1-based r): the token at rank r is evicted under r−1 of the budgets 1 … n−1.
    importance (A, n), rankings (..., A, n); returns (..., A)."""
    ordered = importance.expand_as(rankings).gather(-1, rankings)
    ranks = torch.arange(rankings.shape[-1], dtype=importance.dtype)
    return (ordered * ranks).sum(-1)


def oracle_cost(importance: torch.Tensor) -> torch.Tensor:
    """C(σ*) (A,), σ* the ranking by importance, descending: the minimum over rankings."""
    ordered = torch.sort(importance, dim=-1, descending=True).values
    return (ordered * torch.arange(importance.shape[-1], dtype=importance.dtype)).sum(-1)


def normalised_rewards(importance: torch.Tensor, rankings: torch.Tensor) -> torch.Tensor:
    """R = −C(σ)/C(σ*) (K, A): −1 for an optimal ranking, lower is worse.

    C(σ*) = 0 means at most one token has importance: every ranking that keeps it first is optimal and the
    ratio is undefined, so those agents get R = 0 for every sample (zero advantage, no gradient)."""
    best = oracle_cost(importance)
    defined = best > 0
    return torch.where(defined, -ranking_cost(importance, rankings) / torch.where(defined, best, 1.0), 0.0)


# --- losses --------------------------------------------------------------------------------------------------------


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out: R_k − mean_{j≠k} R_j over the sample axis (dim −2) of rewards (..., K, A)."""
    n_samples = rewards.shape[-2]
    if n_samples < 2:
        raise ValueError("RLOO needs at least two samples per prefix")
    return (rewards - rewards.sum(-2, keepdim=True) / n_samples) * (n_samples / (n_samples - 1))


def policy_gradient_loss(log_probs: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """The RLOO loss of a step's samples, log_probs and rewards (B prefixes, K samples, A agents).

    Advantages are normalised per agent over the step's B·K samples; each agent's loss is the mean of
    −advantage·log π, and the agents' losses are summed so that every agent's gradient is its own."""
    advantages = rloo_advantages(rewards).detach()
    mean = advantages.mean(dim=(0, 1), keepdim=True)
    std = advantages.std(dim=(0, 1), keepdim=True, unbiased=False)
    advantages = (advantages - mean) / (std + 1e-8)
    return -(advantages * log_probs).mean(dim=(0, 1)).sum()


def log_importance_regression_loss(scores: torch.Tensor, importance: torch.Tensor) -> torch.Tensor:
    """Supervised baseline: squared error between the centred scores and the centred log(I + ε) of one prefix,
    scores and importance (A, n), ε = 10⁻³ of the agent's mean importance. Centring makes the loss blind to a
    constant offset, which no ranking can see; the loss is a mean over tokens, summed over agents."""
    eps = 1e-3 * importance.mean(-1, keepdim=True) + torch.finfo(importance.dtype).tiny
    target = torch.log(importance + eps)
    error = (scores - scores.mean(-1, keepdim=True)) - (target - target.mean(-1, keepdim=True))
    return error.pow(2).mean(-1).sum()


def listwise_kl_loss(scores: torch.Tensor, importance: torch.Tensor) -> torch.Tensor:
    """Listwise objective (ListNet's top-one probability): KL(p ‖ softmax(scores)) with p = I / ΣI of one prefix,
    scores and importance (A, n), summed over agents. softmax(scores) is what the evictor's default sum_softmax
    combination adds up over heads, so this fits exactly the quantity a shared eviction ranks by, and it weighs each
    token by its share of the future attention: the few tokens that a question will read dominate it."""
    p = importance / importance.sum(-1, keepdim=True).clamp_min(torch.finfo(importance.dtype).tiny)
    log_q = torch.log_softmax(scores, dim=-1)
    return (torch.special.xlogy(p, p) - p * log_q).sum(-1).sum()


def soft_rank_cost_loss(scores: torch.Tensor, importance: torch.Tensor, n_anchors: int,
                        generator: torch.Generator, temperature: float = 1.0) -> torch.Tensor:
    """The RL reward's cost of the ranking by score, made differentiable: Σ_i I_i·rank_i / C(σ*), with the rank
    rank_i = #{j : s_j > s_i} smoothed to Σ_{j≠i} sigmoid((s_j − s_i)/temperature) (ApproxRank, Qin et al. 2010).
    scores and importance (A, n) of one prefix; summed over agents.

    The sum over i is estimated from n_anchors tokens drawn with replacement in proportion to importance, each
    compared with all n tokens: an unbiased estimate that costs A·n_anchors·n instead of A·n². Agents with
    C(σ*) = 0 contribute 0, as in normalised_rewards. At a small temperature this is nearly the cost of the one
    ranking the evictor uses, where RL's expected reward over Plackett–Luce samples also rewards sharper scores;
    at temperature 1 the sigmoids are that kind of noise again (models/README.md, "Objectives")."""
    tiny = torch.finfo(importance.dtype).tiny
    best = oracle_cost(importance)
    defined = best > 0
    total = importance.sum(-1)
    weights = torch.where(defined.unsqueeze(-1), importance, torch.ones_like(importance))
    anchors = torch.multinomial(weights, n_anchors, replacement=True, generator=generator)
    anchor_scores = scores.gather(-1, anchors)
    # the self-pair j = i adds sigmoid(0) = 1/2 to every anchor's sum
    soft_ranks = torch.sigmoid((scores.unsqueeze(1) - anchor_scores.unsqueeze(-1)) / temperature).sum(-1) - 0.5
    cost = total * soft_ranks.mean(-1)
    return torch.where(defined, cost / torch.where(defined, best, tiny), 0.0).sum()


def clip_grad_norm_per_agent_(parameters: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clips each agent's gradient (the slice a of every (A, …) parameter) to norm ≤ max_norm, as if every agent
    were trained alone; returns the (A,) norms before clipping."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norms = torch.stack([g.pow(2).flatten(1).sum(1) for g in grads]).sum(0).sqrt()
    factor = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(factor.view(-1, *([1] * (g.dim() - 1))))
    return norms
