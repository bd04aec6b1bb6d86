"""End-to-end fine-tuning: the reward of a kept set is the model's own likelihood of the answer read from it.

    python -m training.e2e --init models/smollm2-135m-instruct.kvp.bin --samples-per-task 5 --steps 200 \
        --out e2e.kvp.bin

Every target the other objectives fit is token by token (the attention a token will receive), and on counting
tasks (fwe) the sets they prefer score worse than keydiff's: `benchmarks/kept_set_criteria.py` shows that neither the
target nor the attention outputs of a kept set order two policies' sets as their task scores do, while the model's
likelihood of the gold answer from the compressed cache does. This objective uses that likelihood directly.

Each episode is a RULER sample (task t drawn with seed --seed + t, as training.capture_traces draws the trace
corpus; every 5th sample of a task, held out there, is skipped) whose prompt, all but its last token, is prefilled
once into a stock llama.cpp context: its keys and values are the agents' inputs, and the context's state is saved.
A step takes one episode and one budget, scores the prompt with the policy (its agents' scores plus recency terms,
combined over heads as shared eviction does, ``sum_softmax``) and draws K kept sets from the Plackett–Luce
distribution of the combined score (Gumbel-sort; the first 4 and last 16 tokens always kept, then the first
budget − 20 of the sampled order). A kept set's reward is minus the answer's mean negative log-likelihood when the
model reads it from the context with the other tokens removed (``llama_memory_seq_rm``, original positions, as the
engine evicts); the update is RLOO on the log-probability of the sampled picks, starting from a trained policy
(``--init``), with AdamW, cosine decay and per-agent clipping at 5. Kept sets are drawn token by token; the engine's
default unit, whole words, is not modelled here.

With --kv-mode per_head every (layer, KV head) draws its own kept set from its own agent's scores (no combining),
the picks' log-probability is the sum over agents, and the kept sets are evicted head by head with
``llama_kvp_evict`` on the patched llama.cpp (flash attention on), as ``Llama(kv_mode="per_head")`` evicts: the
reward of per-head eviction, which the token-level objectives only approximate.

Runs are deterministic for a seed and thread count, checkpoint every --checkpoint-every steps (to OUT.ckpt) and
continue with --resume. --heldout-samples N also reports the greedy kept sets' NLL on N samples per task that the
run never trains on (the held-out 5th samples): whether what it learned carries over, before any kvp-bench run.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import List, Optional, Sequence

import numpy as np
import torch

from kvp_cpp import policy_file as pf

from . import rl
from .likelihood import AnswerLikelihood
from .train import require_same_run, save_checkpoint

__all__ = ["Episode", "shared_log_score", "picks_log_prob", "kept_mask", "stack_from_policy", "pick_samples",
           "build_episodes", "agent_logits", "combined_logits", "ranking_logits", "kept_sets", "KeptSetReward",
           "per_head_cache_agents", "greedy_nll", "run_config", "train", "main"]

# Arguments that define a run: a checkpoint only resumes a run with the same values.
RUN_KEYS = ("init", "model", "tasks", "samples_per_task", "length", "budgets", "steps", "samples", "lr",
            "weight_decay", "clip", "seed", "heldout_samples", "kv_mode")
# Run keys added after some checkpoints were written, with the value those runs had.
NEWER_RUN_KEYS = {"heldout_samples": 0, "kv_mode": "shared"}


def shared_log_score(scores: torch.Tensor) -> torch.Tensor:
    """log Σ_a softmax_a(scores[a]) over the agents of scores (A, n): the log of shared eviction's sum_softmax."""
    return torch.logsumexp(torch.log_softmax(scores, dim=-1), dim=0)


def picks_log_prob(logits: torch.Tensor, orders: torch.Tensor, n_picks: int) -> torch.Tensor:
    """log-probability (K,) of the first n_picks of each order (K, n) under the Plackett–Luce distribution of logits
    (n,): Σ_{r < n_picks} [z_σr − log Σ_{t ≥ r} exp z_σt]; (K, A) for logits (A, n) and orders (K, A, n)."""
    ordered = logits.expand_as(orders).gather(-1, orders)
    suffix = torch.logcumsumexp(ordered.flip(-1), dim=-1).flip(-1)
    return (ordered - suffix)[..., :n_picks].sum(-1)


def kept_mask(n_tokens: int, n_sink: int, n_recent: int, order: np.ndarray, n_picks: int) -> np.ndarray:
    """The kept tokens of a prompt of n_tokens: the sinks, the recent ones and the first n_picks of ``order``, an
    order of the rankable tokens n_sink … n_tokens − n_recent − 1 given as offsets from n_sink."""
    kept = np.zeros(n_tokens, bool)
    kept[:n_sink] = True
    kept[n_tokens - n_recent:] = True
    kept[n_sink + np.asarray(order[:n_picks], np.int64)] = True
    return kept


def stack_from_policy(policy: pf.PolicyData, generator: torch.Generator):
    """(AgentStack of a policy's agents, their (layer, head) in stack order)."""
    slots = sorted(policy.agents)
    first = policy.agents[slots[0]]
    stack = rl.AgentStack(len(slots), first.shift.shape[0], policy.hidden, policy.activation,
                          np.stack([policy.agents[s].shift for s in slots]),
                          np.stack([policy.agents[s].scale for s in slots]), generator,
                          policy.n_recency_knots if policy.recency else 0)
    with torch.no_grad():
        for index, slot in enumerate(slots):
            agent = policy.agents[slot]
            for weight, bias, w, b in zip(stack.weights, stack.biases, agent.weights, agent.biases):
                weight[index] = torch.from_numpy(np.asarray(w, np.float32).T)
                bias[index, 0] = torch.from_numpy(np.asarray(b, np.float32))
            if stack.recency is not None:
                stack.recency[index] = torch.from_numpy(np.asarray(policy.recency[slot], np.float32))
    return stack, slots


@dataclass
class Episode:
    name: str
    inputs: torch.Tensor  # (A, c, D) agent inputs of the prefilled tokens
    state: object  # the context after prefilling them
    tail: List[int]  # the prompt's last token and the answer but its last token
    answer: List[int]

    @property
    def n_tokens(self) -> int:
        return self.inputs.shape[1]


def pick_samples(drawn, count: int, heldout: bool) -> list:
    """The first count samples of a task's draw that training.capture_traces trains on (heldout: that it holds out,
    every 5th)."""
    return [sample for position, sample in enumerate(drawn) if (position % 5 == 4) == heldout][:count]


def build_episodes(args, policy: pf.PolicyData, slots, capture, heldout: bool = False) -> List[Episode]:
    """The training episodes, or with ``heldout`` the first --heldout-samples of each task's held-out samples."""
    from kvp_cpp.ruler import SYNTHETIC_TASKS, LlamaTokenizer, generate
    from tqdm import tqdm

    tokenizer = LlamaTokenizer(capture.llm.model_path)
    samples = []
    for task in args.tasks or SYNTHETIC_TASKS:
        # seeded as training.capture_traces seeds its RULER documents; every 5th is held out there, and skipped here
        count = args.heldout_samples * 5 if heldout else args.samples_per_task * 5 // 4 + 1
        drawn = generate(task, args.length, count, tokenizer, "chat",
                         seed=args.seed + list(SYNTHETIC_TASKS).index(task))
        samples += pick_samples(drawn, args.heldout_samples if heldout else args.samples_per_task, heldout)
    episodes = []
    layers = sorted({layer for layer, _ in slots})
    for sample in tqdm(samples, desc="held-out episodes" if heldout else "episodes", file=sys.stderr,
                       disable=args.quiet):
        llm = capture.llm
        prompt = llm.tokenize((sample["input"] + sample["answer_prefix"]).encode(), add_bos=False, special=True)
        answer = llm.tokenize((" " + ", ".join(sample["outputs"])).encode(), add_bos=False, special=False)
        out = capture.run(prompt[:-1])
        state = llm.save_state()
        n = len(prompt) - 1
        # rl.agent_inputs reads (H, n, d) keys and values per layer, as the f16 cache holds them; its agent order,
        # layer slot · H + head, is the order of slots
        per_layer = [SimpleNamespace(**{name: out[node][layer].astype(np.float16).astype(np.float32).transpose(1, 0, 2)
                                        for name, node in (("k", "Kcur"), ("v", "Vcur"))}) for layer in layers]
        inputs = rl.agent_inputs(per_layer, pf.pos_features(policy.pos_features, np.arange(n)))
        episodes.append(Episode(f"{sample['task']}/{sample['index']}", torch.from_numpy(inputs), state,
                                prompt[-1:] + answer[:-1], answer))
    return episodes


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m training.e2e", description=__doc__.split("\n\n")[0])
    p.add_argument("--init", required=True, help="the trained kvp.bin policy to fine-tune")
    p.add_argument("--out", required=True)
    p.add_argument("-m", "--model", default=None)
    p.add_argument("--tasks", type=lambda t: [x for x in t.split(",") if x], default=None,
                   help="comma-separated RULER tasks (default: the six synthetic ones)")
    p.add_argument("--samples-per-task", type=int, default=5)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--budgets", type=lambda t: [int(x) for x in t.split(",") if x], default=[128, 256, 512, 1024])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--samples", type=int, default=8, help="K, kept sets drawn per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-t", "--threads", type=int, default=1)
    p.add_argument("--kv-mode", choices=("shared", "per_head"), default="shared",
                   help="shared: one kept set for all heads, drawn from their combined score (stock llama.cpp); "
                        "per_head: every (layer, KV head) draws its own from its agent's score, evicted with the "
                        "patched llama.cpp (python -m kvp_cpp.llama_build; the command restarts itself on it)")
    p.add_argument("--heldout-samples", type=int, default=0,
                   help="held-out samples per task on which to report the greedy kept sets' NLL before and after")
    p.add_argument("--checkpoint", help="checkpoint file (default: OUT.ckpt)")
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint")
    p.add_argument("--stop-at", type=int, help="checkpoint and stop after this many steps, without exporting")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.checkpoint is None:
        args.checkpoint = args.out + ".ckpt"
    if args.samples < 2:
        p.error("--samples must be at least 2 (RLOO)")
    from kvp_cpp.ruler import SYNTHETIC_TASKS

    unknown = [task for task in args.tasks or () if task not in SYNTHETIC_TASKS]
    if unknown:
        p.error(f"--tasks {','.join(unknown)}: not among the synthetic tasks {','.join(SYNTHETIC_TASKS)}")
    if min(args.samples_per_task, args.checkpoint_every) < 1 or not args.budgets or min(args.budgets) < 1:
        p.error("--samples-per-task, --checkpoint-every and --budgets must be positive")
    if args.steps < 0:
        p.error("--steps must be at least 0 (0: only measure the --init policy's NLL)")
    if args.heldout_samples < 0 or (args.stop_at is not None and args.stop_at < 1):
        p.error("--heldout-samples must be at least 0 and --stop-at positive")
    return args


def agent_logits(stack, episode: Episode, policy: pf.PolicyData) -> torch.Tensor:
    """(A, n_rankable) every agent's scores of an episode's rankable tokens, recency terms included."""
    n = episode.n_tokens
    rankable = slice(policy.n_sink, n - policy.n_recent)
    scores = stack(episode.inputs)[:, rankable]
    if stack.recency is not None:
        scores = scores + stack.recency_term(torch.from_numpy(n - np.arange(n)[rankable]))
    return scores


def combined_logits(stack, episode: Episode, policy: pf.PolicyData) -> torch.Tensor:
    """(n_rankable,) log of the heads' summed softmaxes of an episode's rankable tokens, recency terms included."""
    return shared_log_score(agent_logits(stack, episode, policy))


def ranking_logits(stack, episode: Episode, policy: pf.PolicyData, kv_mode: str) -> torch.Tensor:
    """(R, n_rankable): the logits of each ranking a kept set is drawn from: one shared by all heads (R = 1), or
    per head, every agent's own (R = A)."""
    if kv_mode == "per_head":
        return agent_logits(stack, episode, policy)
    return combined_logits(stack, episode, policy).unsqueeze(0)


def kept_sets(episode: Episode, policy: pf.PolicyData, orders: np.ndarray, n_picks: int) -> np.ndarray:
    """(R, n_tokens) kept masks, one per order (R, n_rankable) of ranking_logits' rows."""
    return np.stack([kept_mask(episode.n_tokens, policy.n_sink, policy.n_recent, order, n_picks) for order in orders])


class KeptSetReward:
    """The answer NLL of kept sets (R, n_tokens): one shared set (``llama_memory_seq_rm``), or one per agent, which
    ``cache_agents`` [n_layer, n_head_kv] (the agent of each head of the per-head cache) lays out for
    ``llama_kvp_evict``."""

    def __init__(self, scorer: AnswerLikelihood, cache_agents: Optional[np.ndarray] = None):
        self.scorer, self.cache_agents = scorer, cache_agents

    @property
    def kv_mode(self) -> str:
        return "shared" if self.cache_agents is None else "per_head"

    def __call__(self, episode: Episode, kept: np.ndarray) -> float:
        if self.cache_agents is None:
            return self.scorer.nll(episode.state, kept[0], episode.tail, episode.answer)
        return self.scorer.nll_per_head(episode.state, kept[self.cache_agents], episode.tail, episode.answer)


def per_head_cache_agents(llm, slots: Sequence[tuple]) -> np.ndarray:
    """[n_layer, n_head_kv] agent index of each (cache layer, KV head) of a per-head context; every head needs one."""
    from kvp_cpp import per_head

    layers, n_head = per_head.layers(llm), per_head.n_head_kv(llm)
    index = {slot: a for a, slot in enumerate(slots)}
    missing = [(layer, h) for layer in layers for h in range(n_head) if (layer, h) not in index]
    if missing:
        raise ValueError(f"--kv-mode per_head: the policy has no agent for {len(missing)} (layer, KV head) of the "
                         f"per-head cache, e.g. {missing[:3]}; every head chooses its own tokens")
    return np.array([[index[(layer, h)] for h in range(n_head)] for layer in layers])


def budgets_of(episode: Episode, budgets: Sequence[int]) -> List[int]:
    return [b for b in budgets if b < episode.n_tokens] or [min(budgets)]


def greedy_nll(stack, episodes: Sequence[Episode], budgets: Sequence[int], policy: pf.PolicyData,
               reward: KeptSetReward) -> float:
    """Mean answer NLL over every (episode, budget) of the kept sets the policy itself would keep (no sampling):
    whether training raised the reward it is trained on."""
    values = []
    with torch.no_grad():
        for episode in episodes:
            orders = torch.argsort(ranking_logits(stack, episode, policy, reward.kv_mode), dim=-1, descending=True,
                                   stable=True).numpy()
            for budget in budgets_of(episode, budgets):
                values.append(reward(episode, kept_sets(episode, policy, orders,
                                                        max(0, budget - policy.n_sink - policy.n_recent))))
    return float(np.mean(values))


def run_config(args) -> dict:
    return {key: getattr(args, key) for key in RUN_KEYS}


def train(args) -> Optional[pf.PolicyData]:
    """The fine-tuned policy, or None when --stop-at stopped the run early (its checkpoint continues it)."""
    from kvp_cpp import default_model_path, model_identity
    from kvp_cpp.capture import TensorCapture
    from tqdm import tqdm

    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    policy = pf.read_policy(args.init)
    model = args.model or default_model_path()
    identity = model_identity(model)
    different = {key: (value, identity.get(key)) for key, value in policy.identity().items()
                 if identity.get(key) != value}
    if different:
        raise ValueError(f"--init {args.init} was trained for another model (policy's value, the model's): {different}")
    saved = None
    if args.resume:
        if not os.path.exists(args.checkpoint):
            raise FileNotFoundError(f"--resume: no checkpoint at {args.checkpoint}")
        saved = torch.load(args.checkpoint, weights_only=True)
        require_same_run(saved["config"], run_config(args), NEWER_RUN_KEYS)
    stack, slots = stack_from_policy(policy, generator)
    optimizer = torch.optim.AdamW(stack.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / max(args.steps, 1))))
    step, elapsed_before, measured = 0, 0.0, {}
    if saved is not None:
        stack.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        schedule.load_state_dict(saved["scheduler"])
        generator.set_state(saved["torch_rng"])
        rng.bit_generator.state = saved["numpy_rng"]
        step, elapsed_before, measured = saved["step"], saved["elapsed_s"], dict(saved["measured"])

    per_head_mode = args.kv_mode == "per_head"
    capture = TensorCapture(model, names=("Kcur", "Vcur"), layers=sorted({layer for layer, _ in slots}),
                            n_ctx=args.length + 256, n_threads=args.threads, flash_attn=per_head_mode)
    cache_agents = None
    if per_head_mode:  # before the prefills, whose saved states every per-head eviction starts from
        from kvp_cpp import per_head as kvp_per_head

        kvp_per_head.enable(capture.llm)
        cache_agents = per_head_cache_agents(capture.llm, slots)
    reward = KeptSetReward(AnswerLikelihood(capture.llm, after_decode=capture.recorder.take), cache_agents)
    episodes = build_episodes(args, policy, slots, capture)
    heldout = build_episodes(args, policy, slots, capture, heldout=True) if args.heldout_samples else []
    if "greedy_nll_before" not in measured:  # the initial policy's, measured once per run
        measured["greedy_nll_before"] = greedy_nll(stack, episodes, args.budgets, policy, reward)
        if heldout:
            measured["heldout_greedy_nll_before"] = greedy_nll(stack, heldout, args.budgets, policy, reward)

    started = time.time()

    def checkpoint() -> None:
        save_checkpoint(args.checkpoint, {
            "step": step, "elapsed_s": elapsed_before + time.time() - started, "config": run_config(args),
            "measured": measured, "model": stack.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": schedule.state_dict(), "torch_rng": generator.get_state(),
            "numpy_rng": rng.bit_generator.state})

    stop = args.steps if args.stop_at is None else min(args.steps, args.stop_at)
    progress = tqdm(total=stop, initial=step, desc="e2e", file=sys.stderr, disable=args.quiet)
    while step < stop:
        episode = episodes[rng.integers(len(episodes))]
        budget = int(rng.choice(budgets_of(episode, args.budgets)))
        n_picks = max(0, budget - policy.n_sink - policy.n_recent)
        logits = ranking_logits(stack, episode, policy, reward.kv_mode)  # (R, n_rankable)
        orders = rl.gumbel_rankings(logits, args.samples, generator)  # (K, R, n_rankable)
        rewards = torch.tensor([-reward(episode, kept_sets(episode, policy, order.numpy(), n_picks))
                                for order in orders], dtype=torch.float64)
        advantages = rl.rloo_advantages(rewards.unsqueeze(-1))[:, 0]
        advantages = (advantages - advantages.mean()) / (advantages.std(unbiased=False) + 1e-8)
        loss = -(advantages.to(logits.dtype) * picks_log_prob(logits, orders, n_picks).sum(-1)).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        rl.clip_grad_norm_per_agent_(list(stack.parameters()), args.clip)
        optimizer.step()
        schedule.step()
        step += 1
        progress.set_postfix({"nll": f"{-rewards.mean():.3f}", "budget": budget}, refresh=False)
        progress.update()
        if step % args.checkpoint_every == 0 or step == stop:
            checkpoint()
    progress.close()
    wall_time = elapsed_before + time.time() - started
    if step < args.steps:
        capture.close()
        if not args.quiet:
            print(f"stopped at step {step} of {args.steps}; continue with --resume", file=sys.stderr)
        return None
    if args.steps:
        measured["greedy_nll_after"] = greedy_nll(stack, episodes, args.budgets, policy, reward)
        if heldout:
            measured["heldout_greedy_nll_after"] = greedy_nll(stack, heldout, args.budgets, policy, reward)
    else:  # --steps 0 only measures the --init policy
        measured.update({key.replace("_before", "_after"): value for key, value in list(measured.items())})
    capture.close()
    if not args.quiet:
        print(f"e2e: the policy's own kept sets, mean answer NLL over the {len(episodes)} episodes and their budgets: "
              f"{measured['greedy_nll_before']:.4f} before, {measured['greedy_nll_after']:.4f} after", file=sys.stderr)
        if heldout:
            print(f"e2e: on {len(heldout)} held-out samples: {measured['heldout_greedy_nll_before']:.4f} before, "
                  f"{measured['heldout_greedy_nll_after']:.4f} after", file=sys.stderr)
    result = copy.deepcopy(policy)
    for index, slot in enumerate(slots):
        result.agents[slot] = stack.export(index)
        if stack.recency is not None:
            result.recency[slot] = stack.recency[index].detach().numpy().copy()
    result.metadata = dict(policy.metadata, generator="training.e2e", e2e={
        "init": args.init, "steps": args.steps, "samples": args.samples, "samples_per_task": args.samples_per_task,
        "budgets": args.budgets, "lr": args.lr, "seed": args.seed, "kv_mode": args.kv_mode, "episodes": len(episodes),
        "heldout_episodes": len(heldout), "wall_time_s": round(wall_time, 1),
        **{key: round(value, 5) for key, value in measured.items()}})
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.kv_mode == "per_head":
        from kvp_cpp import _llama_lib

        if argv is None:
            _llama_lib.restart_on_per_head(["-m", "training.e2e", *sys.argv[1:]])
        _llama_lib.require_per_head()
    result = train(args)
    if result is not None:
        pf.write_policy(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
