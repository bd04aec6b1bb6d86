"""Train eviction agents on traces (docs/traces.md) and export them as a kvp.bin policy.

    python -m training.train --traces traces-smollm2 --out policy.kvp.bin --hidden 32 --steps 400 --seed 0

One agent per (layer, KV head): an MLP on (concat(k, v, position features) − shift) · scale, shift/scale being
the per-head mean and 1/std of the training inputs. Every step draws --prefixes-per-step (sequence, cut) pairs from
the training split (a sequence uniformly, then one of its cuts uniformly) and trains the agents of every selected
layer on them at once: all agents are independent slices of batched tensors, their losses are summed and their
gradients clipped one agent at a time, so a step is the paper's update of each agent on the same prefixes.

Objectives: "rl" (Plackett–Luce policy, K Gumbel-sort samples per prefix, reward −C(σ)/C(σ*), RLOO) or
"supervised" (regression of the score on log importance; the comparison row) or "listwise" (KL divergence of
softmax(score) from the prefix's importance distribution, ListNet's top-one loss) or "softrank" (RL's cost
C(σ)/C(σ*) of the ranking by score, with each rank smoothed to a sum of sigmoids and estimated from --anchors tokens
drawn by importance; plus --listwise-weight times the listwise loss). AdamW, linear warm-up from 1 % of the
learning rate, cosine decay to --min-lr, per-agent clipping at norm 5, no entropy term.

Runs are deterministic for a seed and thread count, checkpoint every --checkpoint-every steps and continue with
--resume; the result is evaluated on the held-out split (training.evaluate) and the metrics go into the policy's
metadata.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
from tqdm import tqdm

from kvp_cpp import policy_file as pf

from . import evaluate as ev
from . import rl
from .traces import TraceSet, comma_names

__all__ = ["parse_args", "input_statistics", "Trainer", "TrainResult", "require_same_run", "save_checkpoint", "train",
           "main"]

# Arguments that define a run: a checkpoint only resumes a run with the same values.
RUN_KEYS = (
    "objective", "hidden", "activation", "steps", "seed", "lr", "min_lr", "warmup", "weight_decay", "clip",
    "samples", "prefixes_per_step", "layers", "n_sink", "n_recent", "stat_tokens", "sources", "recency_knots",
    "init", "anchors", "rank_temperature", "listwise_weight",
)  # fmt: skip
# Run keys added after some checkpoints were written, with the value those runs had.
NEWER_RUN_KEYS = {"sources": None, "recency_knots": 0, "init": None, "anchors": 128,
                  "rank_temperature": 0.02, "listwise_weight": 0.0}


OBJECTIVES = ("rl", "supervised", "listwise", "softrank")


def require_same_run(saved_config: dict, config: dict, older_defaults: Optional[dict] = None) -> None:
    """Refuse to resume a checkpoint whose run keys differ from this run's; a key missing from an older
    checkpoint counts as its older_defaults value."""
    saved = {**(older_defaults or {}), **saved_config}
    different = {key: (saved.get(key), value) for key, value in config.items() if saved.get(key) != value}
    if different:
        raise ValueError(f"the checkpoint is of another run (checkpoint value, this run's): {different}")


def save_checkpoint(path: str, state: dict) -> None:
    temporary = path + ".tmp"
    torch.save(state, temporary)
    os.replace(temporary, path)  # a run killed while saving keeps the previous checkpoint


def _int_list(text: str) -> list:
    return [int(part) for part in text.split(",") if part.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m training.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", required=True, help="trace directory (docs/traces.md)")
    parser.add_argument("--out", required=True, help="kvp.bin policy to write")
    parser.add_argument("--objective", choices=OBJECTIVES, default="rl")
    parser.add_argument("--hidden", type=_int_list, default=[32],
                        help="hidden widths, comma-separated (\"\" for a linear agent); default 32")
    parser.add_argument("--activation", choices=pf.ACTIVATIONS, default="relu")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-3,
                        help="peak learning rate; the paper's 5e-5 is for 4000 steps of 256-wide agents, and for "
                             "hidden 32 and a few hundred steps 3e-3 learnt faster than 1e-3 on SmolLM2 traces")
    parser.add_argument("--min-lr", type=float, default=1e-6, help="end of the cosine decay")
    parser.add_argument("--warmup", type=int, help="linear warm-up steps (default min(100, steps // 10))")
    parser.add_argument("--weight-decay", type=float, default=0.01, help="AdamW's decoupled weight decay")
    parser.add_argument("--clip", type=float, default=5.0, help="per-agent gradient norm limit")
    parser.add_argument("--samples", type=int, default=16, help="K, rankings sampled per prefix (rl)")
    parser.add_argument("--anchors", type=int, default=128,
                        help="tokens drawn per prefix and agent to estimate the smoothed cost (softrank)")
    parser.add_argument("--rank-temperature", type=float, default=0.02,
                        help="temperature of the sigmoids that smooth the ranks (softrank): smaller is closer to the "
                             "ranking by score; suits fine-tuning a trained policy (--init)")
    parser.add_argument("--listwise-weight", type=float, default=0.0,
                        help="softrank: add this multiple of the listwise loss, which weighs the top of the ranking")
    parser.add_argument("--prefixes-per-step", type=int, default=2, help="(sequence, cut) pairs per step")
    parser.add_argument("--layers", type=_int_list,
                        help="comma-separated layers to train (default: every layer that attends to the whole "
                             "context; a sliding-window layer never sees the tokens eviction chooses from)")
    parser.add_argument("--sources", type=comma_names,
                        help="comma-separated trace sources to train on (ruler, chats, text; default: all), e.g. "
                             "chats,text for a chat policy like the paper's KVP_S")
    parser.add_argument("--n-sink", type=int, default=4, help="first tokens never ranked (and the policy's default)")
    parser.add_argument("--n-recent", type=int,
                        help="last tokens never ranked (and the policy's default); default 16, or the model's "
                             "sliding window, which the engine always keeps")
    parser.add_argument("--recency-knots", type=int, default=0,
                        help="learn a recency term per agent, added to its score when the evictor ranks: K values at "
                             "token ages 1, 2, 4 … 2^(K−1), interpolated in log2(age) (docs/kvp-bin-format.md); "
                             "0 (default): none, scores depend on the token alone")
    parser.add_argument("--stat-tokens", type=int, default=65536,
                        help="training tokens (evenly strided) that the input normalisation is computed from")
    parser.add_argument("--init", metavar="POLICY",
                        help="start from this kvp.bin policy's agents (its weights, input normalisation and recency "
                             "terms; same model, sizes and --recency-knots) instead of random ones: fine-tuning, "
                             "for example RL after a listwise run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (results depend on it)")
    parser.add_argument("--checkpoint", help="checkpoint file (default: OUT.ckpt)")
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint")
    parser.add_argument("--stop-at", type=int, help="checkpoint and stop after this many steps, without exporting")
    parser.add_argument("--eval-prefixes", type=int, help="evaluate on at most this many held-out prefixes")
    parser.add_argument("--eval-json", help="write the held-out evaluation here")
    parser.add_argument("--eval-plot", help="write the held-out evaluation plot (PNG) here")
    parser.add_argument("--reproducible", action="store_true",
                        help="leave the wall time out of the metadata, so that equal runs write equal bytes")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    args = parser.parse_args(argv)
    if args.warmup is None:
        args.warmup = min(100, args.steps // 10)
    if args.checkpoint is None:
        args.checkpoint = args.out + ".ckpt"
    if args.objective == "rl" and args.samples < 2:
        parser.error("--samples must be at least 2 (RLOO)")
    if not 0 <= args.recency_knots <= pf.MAX_RECENCY_KNOTS:
        parser.error(f"--recency-knots must be within 0..{pf.MAX_RECENCY_KNOTS}")
    if min(args.steps, args.prefixes_per_step, args.checkpoint_every, args.anchors) < 1:
        parser.error("--steps, --prefixes-per-step, --checkpoint-every and --anchors must be positive")
    if not args.rank_temperature > 0:
        parser.error("--rank-temperature must be positive")
    if not args.listwise_weight >= 0:
        parser.error("--listwise-weight must be non-negative")
    return args


def run_config(args: argparse.Namespace) -> dict:
    return {key: getattr(args, key) for key in RUN_KEYS}


def input_statistics(traces: TraceSet, layers: list, features: list, n_sink: int, max_tokens: int,
                     sequences: Optional[Sequence[int]] = None):
    """Per-agent (L·H, D) mean and 1/std of the agent inputs over the training sequences (default: the split).

    Tokens are taken with one stride over every training sequence's cached range (n_sink … last cut − 1; the sink
    tokens, never ranked, often have outlier keys), so that at most max_tokens are read per layer."""
    if sequences is None:
        sequences = traces.sequence_indices("train")
    ranges = [(i, n_sink, max(traces.sequences[i].cuts, default=0)) for i in sequences]
    total = sum(max(end - start, 0) for _, start, end in ranges)
    if total == 0:
        raise ValueError("the training split has no cached tokens")
    stride = max(1, math.ceil(total / max_tokens))
    n_head = traces.n_head_kv
    dim = traces.head_dim_k + traces.head_dim_v + len(features)
    sums = np.zeros((len(layers), n_head, dim))
    squares = np.zeros((len(layers), n_head, dim))
    count = 0
    for index, start, end in ranges:
        tokens = np.arange(start, end, stride)
        if tokens.size == 0:
            continue
        k = traces.keys(index)[layers][:, tokens].astype(np.float64)  # (L, T, H, dk)
        v = traces.values(index)[layers][:, tokens].astype(np.float64)
        pos = pf.pos_features(features, tokens).astype(np.float64)
        pos = np.broadcast_to(pos[None, :, None, :], (len(layers), tokens.size, n_head, len(features)))
        x = np.concatenate([k, v, pos], axis=-1)
        sums += x.sum(axis=1)
        squares += np.square(x).sum(axis=1)
        count += tokens.size
    mean = sums / count
    std = np.sqrt(np.maximum(squares / count - np.square(mean), 0.0))
    scale = np.where(std > 1e-6, 1.0 / np.maximum(std, 1e-6), 1.0)  # constant inputs are only shifted
    return mean.reshape(-1, dim).astype(np.float32), scale.reshape(-1, dim).astype(np.float32)


def warmup_cosine(warmup: int, steps: int, lr: float, min_lr: float):
    """LambdaLR factor: linear warm-up from 0.01 to 1 over `warmup` steps, then cosine decay to min_lr / lr."""
    floor = min_lr / lr

    def factor(step: int) -> float:
        if step < warmup:
            return 0.01 + 0.99 * step / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


@dataclass
class StepStats:
    loss: float  # per agent
    reward: Optional[float]  # mean −C(σ)/C(σ*) of the sampled rankings (rl only)
    greedy_reward: float  # the same for the rankings by score


class Trainer:
    """The model, optimiser, schedule and random streams of one run, and its training step."""

    def __init__(self, traces: TraceSet, args: argparse.Namespace, statistics=None):
        self.traces = traces
        self.args = args
        if args.n_recent is None:
            args.n_recent = max(ev.DEFAULT_RECENT, traces.sliding_window)
        self.layers = traces.global_layers if args.layers is None else list(args.layers)
        if not self.layers or any(not 0 <= layer < traces.n_layer for layer in self.layers):
            raise ValueError(f"--layers {self.layers} must be within 0..{traces.n_layer - 1}")
        self.features = pf.default_pos_features(traces.n_ctx_train)
        self.source_sequences = traces.sequences_of("train", args.sources)
        self.train_sequences = [
            (index, [cut for cut in traces.sequences[index].cuts if cut > args.n_sink + args.n_recent + 1])
            for index in self.source_sequences
        ]
        self.train_sequences = [(index, cuts) for index, cuts in self.train_sequences if cuts]
        if not self.train_sequences:
            raise ValueError(f"{traces.root}: no training prefix is longer than n_sink + n_recent + 1")
        self.generator = torch.Generator().manual_seed(args.seed)
        self.rng = np.random.default_rng(args.seed)
        if statistics is None:
            statistics = input_statistics(traces, self.layers, self.features, args.n_sink, args.stat_tokens,
                                          self.source_sequences)
        shift, scale = statistics
        self.model = rl.AgentStack(
            len(self.layers) * traces.n_head_kv, shift.shape[1], args.hidden, args.activation, shift, scale,
            self.generator, args.recency_knots,
        )  # fmt: skip
        if args.init:
            self.load_initial_policy(pf.read_policy(args.init))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, warmup_cosine(args.warmup, args.steps, args.lr, args.min_lr)
        )
        self.step = 0
        self.elapsed_s = 0.0  # wall time of the run so far, over every resume

    def load_initial_policy(self, policy: pf.PolicyData) -> None:
        """Copy a trained policy's agents into the model; it must have exactly this run's agents and shapes."""
        name = self.args.init
        try:
            layers = ev.scored_layers(policy, self.traces)
        except ValueError as error:
            raise ValueError(f"--init {name}: {error}") from None
        expected = {"hidden": list(self.args.hidden), "activation": self.args.activation,
                    "pos_features": [tuple(f) for f in self.features], "n_recency_knots": self.args.recency_knots,
                    "layers": self.layers}
        found = {"hidden": list(policy.hidden), "activation": policy.activation,
                 "pos_features": [tuple(f) for f in policy.pos_features], "n_recency_knots": policy.n_recency_knots,
                 "layers": layers}
        different = {key: (found[key], value) for key, value in expected.items() if found[key] != value}
        if different:
            raise ValueError(f"--init {name} does not fit this run (policy's value, this run's): {different}")
        n_head = self.traces.n_head_kv
        with torch.no_grad():
            for slot, layer in enumerate(self.layers):
                for head in range(n_head):
                    agent, index = policy.agents[layer, head], slot * n_head + head
                    self.model.shift[index, 0] = torch.from_numpy(np.asarray(agent.shift, np.float32))
                    self.model.scale[index, 0] = torch.from_numpy(np.asarray(agent.scale, np.float32))
                    for weight, bias, w, b in zip(self.model.weights, self.model.biases, agent.weights, agent.biases):
                        weight[index] = torch.from_numpy(np.asarray(w, np.float32).T)
                        bias[index, 0] = torch.from_numpy(np.asarray(b, np.float32))
                    if self.model.recency is not None:
                        self.model.recency[index] = torch.from_numpy(
                            np.asarray(policy.recency[layer, head], np.float32))

    def sample_prefixes(self) -> list:
        chosen = []
        for _ in range(self.args.prefixes_per_step):
            index, cuts = self.train_sequences[self.rng.integers(len(self.train_sequences))]
            chosen.append((index, cuts[self.rng.integers(len(cuts))]))
        return chosen

    def prefix_tensors(self, index: int, cut: int):
        """Agent inputs (A, c, D), the rankable slice, the importance (A, n) and the ages (n,) of its tokens."""
        layer_traces = self.traces.read_prefix(index, cut, self.layers)
        features = pf.pos_features(self.features, layer_traces[0].positions)
        inputs = torch.from_numpy(rl.agent_inputs(layer_traces, features))
        importance = np.stack([t.importance for t in layer_traces]).reshape(inputs.shape[0], cut)
        rankable = slice(self.args.n_sink, cut - self.args.n_recent)
        ages = torch.from_numpy(cut - layer_traces[0].positions[rankable])
        return inputs, rankable, torch.from_numpy(importance[:, rankable]), ages

    def train_step(self) -> StepStats:
        log_probs, rewards, greedy, supervised_losses = [], [], [], []
        for index, cut in self.sample_prefixes():
            inputs, rankable, importance, ages = self.prefix_tensors(index, cut)
            scores = self.model(inputs)[:, rankable]
            if self.model.recency is not None:
                scores = scores + self.model.recency_term(ages)
            with torch.no_grad():
                by_score = torch.sort(scores, dim=-1, descending=True, stable=True).indices
                greedy.append(rl.normalised_rewards(importance, by_score).mean())
            if self.args.objective == "rl":
                rankings = rl.gumbel_rankings(scores, self.args.samples, self.generator)
                log_probs.append(rl.plackett_luce_log_prob(scores, rankings))
                rewards.append(rl.normalised_rewards(importance, rankings))
            elif self.args.objective == "listwise":
                supervised_losses.append(rl.listwise_kl_loss(scores, importance))
            elif self.args.objective == "softrank":
                loss = rl.soft_rank_cost_loss(scores, importance, self.args.anchors, self.generator,
                                              self.args.rank_temperature)
                if self.args.listwise_weight:
                    loss = loss + self.args.listwise_weight * rl.listwise_kl_loss(scores, importance)
                supervised_losses.append(loss)
            else:
                supervised_losses.append(rl.log_importance_regression_loss(scores, importance))
        if self.args.objective == "rl":
            loss = rl.policy_gradient_loss(torch.stack(log_probs), torch.stack(rewards))
            reward = float(torch.stack(rewards).mean())
        else:
            loss = torch.stack(supervised_losses).mean()
            reward = None
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        rl.clip_grad_norm_per_agent_(list(self.model.parameters()), self.args.clip)
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        return StepStats(loss.item() / self.model.n_agents, reward, float(torch.stack(greedy).mean()))

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "elapsed_s": self.elapsed_s,
            "config": run_config(self.args),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "torch_rng": self.generator.get_state(),
            "numpy_rng": self.rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict) -> None:
        require_same_run(state["config"], run_config(self.args), NEWER_RUN_KEYS)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.generator.set_state(state["torch_rng"])
        self.rng.bit_generator.state = state["numpy_rng"]
        self.step = state["step"]
        self.elapsed_s = state["elapsed_s"]

    def save_checkpoint(self, path: str) -> None:
        save_checkpoint(path, self.state_dict())

    def export(self, metadata: dict) -> pf.PolicyData:
        n_head = self.traces.n_head_kv
        return pf.PolicyData(
            **self.traces.identity(),
            pos_features=self.features,
            hidden=list(self.args.hidden),
            activation=self.args.activation,
            weight_dtype="f32",
            n_sink=self.args.n_sink,
            n_recent=self.args.n_recent,
            layer_scored=[layer in self.layers for layer in range(self.traces.n_layer)],
            agents={(layer, head): self.model.export(slot * n_head + head)
                    for slot, layer in enumerate(self.layers) for head in range(n_head)},  # fmt: skip
            metadata=metadata,
            recency={} if self.model.recency is None else
                    {(layer, head): self.model.recency[slot * n_head + head].detach().numpy().copy()
                     for slot, layer in enumerate(self.layers) for head in range(n_head)},  # fmt: skip
        )


@dataclass
class TrainResult:
    trainer: Trainer
    policy: Optional[pf.PolicyData]  # None when stopped early (--stop-at)
    evaluation: Optional[dict]  # None without held-out prefixes


def _metadata(trainer: Trainer, wall_time: Optional[float]) -> dict:
    traces, args = trainer.traces, trainer.args
    widths = [trainer.model.input_dim, *args.hidden, 1]
    metadata = {
        "generator": "training.train",
        "objective": args.objective,
        "data": {
            "traces": os.path.basename(os.path.normpath(traces.root)),
            "model": {key: value for key, value in traces.model.items() if key != "path"},
            "n_future": traces.n_future,
            "train_sequences": len(trainer.source_sequences),
            "train_prefixes": sum(len(cuts) for _, cuts in trainer.train_sequences),
            "heldout_sequences": len(traces.sequence_indices("heldout")),
        },
        "sizes": {
            "agents": trainer.model.n_agents,
            "input_dim": trainer.model.input_dim,
            "hidden": list(args.hidden),
            "parameters_per_agent": sum(n_in * n_out + n_out for n_in, n_out in zip(widths[:-1], widths[1:])),
        },
        "steps": trainer.step,
        "seed": args.seed,
        "threads": args.threads,
        "hyperparameters": run_config(args),
    }
    if wall_time is not None:
        metadata["wall_time_s"] = round(wall_time, 1)
    return metadata


def train(args: argparse.Namespace) -> TrainResult:
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    started = time.perf_counter()
    traces = TraceSet(args.traces)
    if args.resume:
        if not os.path.exists(args.checkpoint):
            raise FileNotFoundError(f"--resume: no checkpoint at {args.checkpoint}")
        state = torch.load(args.checkpoint, weights_only=True)
        saved_shift = state["model"]["shift"][:, 0].numpy()  # the statistics come with the model's state
        trainer = Trainer(traces, args, statistics=(saved_shift, np.ones_like(saved_shift)))
        trainer.load_state_dict(state)
    else:
        trainer = Trainer(traces, args)

    stop = args.steps if args.stop_at is None else min(args.steps, args.stop_at)
    elapsed_before = trainer.elapsed_s
    progress = tqdm(total=stop, initial=trainer.step, disable=args.quiet, desc=f"train ({args.objective})")
    while trainer.step < stop:
        stats = trainer.train_step()
        postfix = {"loss": f"{stats.loss:.4f}", "greedy": f"{stats.greedy_reward:.3f}"}
        if stats.reward is not None:
            postfix["reward"] = f"{stats.reward:.3f}"
        progress.set_postfix(postfix, refresh=False)
        progress.update()
        if trainer.step % args.checkpoint_every == 0 or trainer.step == stop:
            trainer.elapsed_s = elapsed_before + time.perf_counter() - started
            trainer.save_checkpoint(args.checkpoint)
    progress.close()
    if trainer.step < args.steps:
        if not args.quiet:
            print(f"stopped at step {trainer.step} of {args.steps}; continue with --resume", file=sys.stderr)
        return TrainResult(trainer, None, None)

    wall_time = None if args.reproducible else elapsed_before + time.perf_counter() - started
    metadata = _metadata(trainer, wall_time)
    policy = trainer.export(metadata)
    evaluation = None
    if traces.prefixes("heldout"):
        evaluation = ev.evaluate(traces, policy, max_prefixes=args.eval_prefixes, seed=args.seed)
        metadata["heldout"] = ev.summary(evaluation)
        if args.eval_json:
            with open(args.eval_json, "w", encoding="utf-8") as f:
                json.dump(evaluation, f, indent=1)
        if args.eval_plot:
            ev.plot(evaluation, args.eval_plot)
        if not args.quiet:
            ev.print_table(evaluation)
    pf.write_policy(args.out, policy)
    return TrainResult(trainer, policy, evaluation)


def main(argv=None) -> int:
    train(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
