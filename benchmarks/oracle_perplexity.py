"""Perplexity when the cache keeps the tokens the continuation will attend to: the oracle, a bound for any ranking.

    python benchmarks/oracle_perplexity.py --text benchmarks/results/heldout_chats.jsonl --ctx 1024 --cont 128 \
        --budgets 256,512 -o benchmarks/results/ppl_heldout_oracle.samples.jsonl \
        --check benchmarks/results/ppl_heldout.samples.jsonl

The windows and the protocol are kvp-bench's (`--text FILE --ctx C --cont F`, oneshot): the first C + F tokens of
each document, C - 1 of them prefilled and compressed to the budget, then the last prompt token and the continuation
fed, and the mean negative log-likelihood of the F continuation tokens. What is kept:
- ``oracle``, per head (``kv_mode`` per_head): each (layer, KV head) keeps the cached tokens that receive the most
  attention from the F queries fed after the compression (training.importance: causal softmax over the uncompressed
  window, llama.cpp's scale, max over the GQA group, summed over the queries), the paper's oracle;
- ``oracle``, shared: one token set for every head, ranked by the sum over heads of each head's share of that
  attention (the heads count alike);
- ``oracle-value``, per head and shared: the same with each token's attention multiplied by the norm of its value
  vector in that head (what the token can add to the attention output, as value-aware pruning weighs it);
- ``observed``, per head and shared: not an oracle but its causal counterpart, the same attention observed from
  the last ``--observe`` prefilled tokens' queries (default: as many as the continuation's) instead of the
  continuation's, each token's sum divided by the number of those queries that can see it, so that tokens inside
  the observed window are not ranked down for having fewer queries after them. It is what a policy that reads the
  prompt's own attention (SnapKV, H2O, TOVA) could know at best, with this target and no pooling;
- ``full`` and ``streaming`` through the same code, to check it against a kvp-bench log (``--check``).
The first 4 and the last 16 prefilled tokens are always kept, as the engine does. Every configuration evicts through
the patched llama.cpp's per-head eviction (a shared set is the same positions for every head), so the script starts
itself again with ``KVP_CPP_LLAMA=per_head``; build the library first with ``python -m kvp_cpp.llama_build``. Needs numpy and tqdm
(the ``train`` or ``test`` extra).

Records are kvp-bench's per-sample records, so ``python -m kvp_cpp.compare`` pairs them with kvp-bench's logs.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from typing import Dict, List, Optional

import numpy as np

N_SINK, N_RECENT = 4, 16
# the attention a token will receive (the paper's target), and that attention times the norm of the token's value
ORACLES = ("oracle", "oracle-value")
RANKINGS = ORACLES + ("observed",)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--text", required=True, help="a .jsonl file of {\"text\": ...} documents, as for kvp-bench --text")
    p.add_argument("--model", default=None, help="GGUF model (default: the package's default model)")
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--cont", type=int, default=128)
    p.add_argument("--budgets", default="256,512")
    p.add_argument("--observe", type=int, default=None,
                   help="prefilled tokens whose queries rank the tokens for `observed` (default: --cont)")
    p.add_argument("--samples", type=int, default=0, help="at most this many windows, as kvp-bench --samples (0: all)")
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("-o", "--out", required=True, help="per-sample records (.jsonl), resumed if it exists")
    p.add_argument("--check", default=None,
                   help="a kvp-bench log of the same windows, run with --evict-unit token: its full and streaming "
                   "scores must match these")
    args = p.parse_args(argv)
    args.budgets = [int(b) for b in args.budgets.split(",")]
    args.observe = args.cont if args.observe is None else args.observe
    if args.ctx < N_SINK + N_RECENT + 2 or args.cont < 1:
        p.error("--ctx must leave room for the 4 sink and 16 recent tokens, and --cont must be >= 1")
    for b in args.budgets:
        if not N_SINK + N_RECENT < b < args.ctx - 1:
            p.error(f"budget {b}: each must be above {N_SINK + N_RECENT} and below --ctx - 1")
    if not 1 <= args.observe <= args.ctx - 1:
        p.error(f"--observe {args.observe}: must be between 1 and --ctx - 1 (the prefilled tokens)")
    return args


def windows(llm, path: str, ctx: int, cont: int, max_windows: int):
    """kvp-bench's windows of a .jsonl text file: consecutive ctx + cont tokens of each document."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            tokens = llm.tokenize(json.loads(line)["text"].encode(), add_bos=True, special=True)
            for start in range(0, len(tokens) - (ctx + cont) + 1, ctx + cont):
                if max_windows and len(out) >= max_windows:
                    return out
                out.append(tokens[start:start + ctx + cont])
    return out


def oracle_keep(importance, budget: int):
    """(per_head_keep [L, H, k], shared_keep [k]): positions of the rankable tokens kept, k = budget - protected."""
    n = importance.shape[-1]
    rankable = np.arange(N_SINK, n - N_RECENT)
    k = budget - N_SINK - N_RECENT
    by_head = importance[:, :, rankable]
    # stable: ties keep the older token first, the same in every run
    per_head = rankable[np.argsort(-by_head, axis=-1, kind="stable")[:, :, :k]]
    share = importance / importance.sum(axis=-1, keepdims=True)
    shared = rankable[np.argsort(-share[:, :, rankable].sum(axis=(0, 1)), kind="stable")[:k]]
    return per_head, shared


def evicted(keep, n: int):
    """Positions to drop per head, [L, H, n - budget], from the rankable positions kept per head ([L, H, k])."""
    L, H, _ = keep.shape
    drop = np.ones((L, H, n), dtype=bool)
    drop[:, :, :N_SINK] = False
    drop[:, :, n - N_RECENT:] = False
    for il in range(L):
        for ih in range(H):
            drop[il, ih, keep[il, ih]] = False
    counts = drop.sum(axis=-1)
    assert (counts == counts.flat[0]).all()
    return np.nonzero(drop)[2].reshape(L, H, int(counts.flat[0])).astype(np.int32)


class Evaluator:
    """One llama.cpp context, per-head eviction enabled: prefill, drop given positions per head, score the rest."""

    def __init__(self, model: str, n_ctx: int, n_batch: int, threads: Optional[int]):
        import llama_cpp
        from kvp_cpp import per_head

        self.llama_cpp, self.per_head = llama_cpp, per_head
        self.llm = llama_cpp.Llama(model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, flash_attn=True,
                                   n_threads=threads, n_threads_batch=threads, verbose=False)
        per_head.enable(self.llm)
        self.n_batch = n_batch
        self.n_vocab = self.llm.n_vocab()
        self.prefilled = None

    def decode(self, tokens: List[int], n_past: int, want_logits: bool):
        llama_cpp = self.llama_cpp
        rows = []
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start:start + self.n_batch]
            batch = llama_cpp._internals.LlamaBatch(n_tokens=len(chunk), embd=0, n_seq_max=1, verbose=False)
            batch.set_batch(chunk, n_past=n_past + start, logits_all=want_logits)
            rc = llama_cpp.llama_decode(self.llm._ctx.ctx, batch.batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            if want_logits:
                logits = llama_cpp.llama_get_logits(self.llm._ctx.ctx)
                rows.append(np.ctypeslib.as_array(logits, shape=(len(chunk), self.n_vocab)).copy())
        return np.concatenate(rows) if want_logits else None

    def prefill(self, window: List[int], ctx: int) -> None:
        """Prefills window[:ctx - 1] once and keeps a copy of the context's state, which every mean_nll of this
        window starts from instead of prefilling again."""
        llama_cpp, c = self.llama_cpp, self.llm._ctx.ctx
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(c), True)
        self.decode(window[:ctx - 1], 0, want_logits=False)
        state = (ctypes.c_uint8 * llama_cpp.llama_state_get_size(c))()
        size = llama_cpp.llama_state_get_data(c, state, len(state))
        self.prefilled = (list(window[:ctx - 1]), state, size)

    def mean_nll(self, window: List[int], ctx: int, drop) -> float:
        """From the prefilled window[:ctx - 1] (prefill()), drop ``drop`` ([L, H, m] positions, or None), then the
        NLL of window[ctx:]."""
        llama_cpp, c = self.llama_cpp, self.llm._ctx.ctx
        tokens, state, size = self.prefilled
        if tokens != list(window[:ctx - 1]):
            raise AssertionError("mean_nll of a window that was not the last one prefilled")
        # A whole-state load puts the cells back and gives every head the position of each cell (the patch's
        # llama_kvp_set_head_pos note): before any eviction that is the state prefill() saved.
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(c), True)
        if llama_cpp.llama_state_set_data(c, state, size) != size:
            raise RuntimeError("llama_state_set_data did not restore the prefilled state")
        kept = ctx - 1
        restored = self.per_head.positions(self.llm, kept)
        if not (restored == np.arange(kept, dtype=np.int32)).all():
            raise AssertionError("after the state load the heads do not hold the prefilled positions 0 .. ctx - 2")
        if drop is not None:
            self.per_head.evict(self.llm, drop)
            kept -= drop.shape[2]
        counts = self.per_head.cell_counts(self.llm)
        if not (counts == kept).all():
            raise AssertionError(f"after eviction the heads hold {counts.min()}..{counts.max()} cells, not {kept}")
        logits = self.decode(window[ctx - 1:-1], ctx - 1, want_logits=True).astype(np.float64)
        target = np.asarray(window[ctx:])
        top = logits.max(axis=1, keepdims=True)
        log_z = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
        return float(np.mean(log_z - logits[np.arange(len(target)), target]))


def observed_importance(q, k, n_prefilled: int, n_observe: int, scale: float):
    """[H_kv, n_prefilled]: the mean attention (max over the GQA group) each prefilled token receives from the
    queries of the last ``n_observe`` prefilled tokens that can see it."""
    from training.importance import causal_attention, received

    first = n_prefilled - n_observe
    weights = causal_attention(q[first:n_prefilled], k[:n_prefilled], scale, first)
    seen_by = np.minimum(n_observe, n_prefilled - np.arange(n_prefilled))
    return received(weights, k.shape[1]) / seen_by


def importance_of(capture, window: List[int], ctx: int, cont: int, observe: int) -> Dict[str, np.ndarray]:
    """[L, H_kv, ctx - 1] per ranking: the attention each prefilled token receives from the ``cont`` queries fed
    after compression (oracle), the same times the norm of the token's value in that head (oracle-value), and the
    mean attention it received from the last ``observe`` prefilled tokens (observed)."""
    from training.importance import importance

    out = capture.run(window[:-1])
    q, k, v = out["Qcur"], out["Kcur"], out["Vcur"]
    layers = sorted(q)
    scale = 1.0 / np.sqrt(k[layers[0]].shape[-1])
    attention = np.stack([importance(q[il], k[il], ctx - 1, cont, scale) for il in layers])
    value_norm = np.stack([np.linalg.norm(v[il][:ctx - 1].astype(np.float64), axis=-1).T for il in layers])
    observed = np.stack([observed_importance(q[il], k[il], ctx - 1, observe, scale) for il in layers])
    return {"oracle": attention, "oracle-value": attention * value_norm, "observed": observed}


def check_against(records: List[dict], path: str) -> Dict[str, float]:
    """Largest |difference| per series between these full/streaming scores and a kvp-bench log's.

    The script evicts token by token, so only the log's token-level records compare; a series that the log holds
    only with whole words (kvp-bench's default unit) is an error rather than silently left out."""
    theirs, by_words = {}, set()
    with open(path, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if (r.get("protocol") == "oneshot" and r["policy"] in ("full", "streaming")
                    and r.get("kv_mode", "shared") == "shared"):
                key = (r["policy"], r.get("budget"), r["index"])
                if r.get("evict_unit", "token") == "token":
                    theirs[key] = r["score"]
                else:
                    by_words.add(key)
    worst: Dict[str, float] = {}
    ranked_by_words = set()
    for r in records:
        key = (r["policy"], r.get("budget"), r["index"])
        name = r["policy"] + ("" if r.get("budget") is None else f" {r['budget']}")
        if key in theirs:
            worst[name] = max(worst.get(name, 0.0), abs(r["score"] - theirs[key]))
        elif key in by_words:
            ranked_by_words.add(name)
    ranked_by_words -= set(worst)
    if ranked_by_words:
        raise SystemExit(f"--check {path}: its {', '.join(sorted(ranked_by_words))} records were evicted by whole "
                         "words (kvp-bench's default unit), which this script does not do; rerun kvp-bench with "
                         "--evict-unit token")
    if not worst:
        raise SystemExit(f"--check {path}: no oneshot full or streaming record of the same windows to compare")
    return worst


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    from kvp_cpp._llama_lib import restart_on_per_head

    restart_on_per_head(sys.argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # training.importance

    import kvp_cpp
    from kvp_cpp.capture import TensorCapture
    from tqdm import tqdm

    model = args.model or kvp_cpp.default_model_path()
    n_ctx = args.ctx + args.cont
    capture = TensorCapture(model, names=("Qcur", "Kcur", "Vcur"), n_ctx=n_ctx + 64, n_threads=args.threads)
    evaluator = Evaluator(model, n_ctx + 64, 512, args.threads)
    items = windows(capture.llm, args.text, args.ctx, args.cont, args.samples)
    done = {}
    if os.path.exists(args.out):
        with open(args.out, encoding="utf-8") as f:
            for line in f:
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                done[(r["index"], r["policy"], r.get("kv_mode"), r.get("budget"))] = r
    base = {"model": os.path.basename(model), "protocol": "oneshot", "variant": "continuation",
            "task": "ppl:" + os.path.splitext(os.path.basename(args.text))[0], "length": args.ctx,
            "metric": "mean_nll", "prompt_tokens": args.ctx, "context_tokens": args.ctx - 1,
            "generated_tokens": args.cont}
    n_prefilled = args.ctx - 1
    L, H = evaluator.per_head.n_layer(evaluator.llm), evaluator.per_head.n_head_kv(evaluator.llm)
    records = list(done.values())
    with open(args.out, "a", encoding="utf-8") as log, tqdm(total=len(items), desc="windows") as bar:
        for index, window in enumerate(items):
            configs = [("full", "shared", None)] + [("streaming", "shared", b) for b in args.budgets]
            configs += [(name, mode, b) for name in RANKINGS for mode in ("shared", "per_head") for b in args.budgets]
            todo = [c for c in configs if (index, c[0], c[1], c[2]) not in done]
            keep = {}
            if todo:
                evaluator.prefill(window, args.ctx)
            if any(policy in RANKINGS for policy, _, _ in todo):
                targets = importance_of(capture, window, args.ctx, args.cont, args.observe)
                if targets["oracle"].shape[:2] != (L, H):
                    raise SystemExit(f"the model has {targets['oracle'].shape[0]} attention layers but its per-head "
                                     f"cache holds {L}: models with sliding-window layers are not supported")
                keep = {(name, b): oracle_keep(targets[name], b) for name in RANKINGS for b in args.budgets}
            for policy, mode, budget in todo:
                start = time.perf_counter()
                if policy == "full":
                    drop = None
                elif policy == "streaming":
                    recent = np.arange(n_prefilled - (budget - N_SINK), n_prefilled - N_RECENT)
                    drop = evicted(np.broadcast_to(recent, (L, H, len(recent))), n_prefilled)
                elif mode == "per_head":
                    drop = evicted(keep[policy, budget][0], n_prefilled)
                else:
                    shared = keep[policy, budget][1]
                    drop = evicted(np.broadcast_to(shared, (L, H, len(shared))), n_prefilled)
                record = dict(base, index=index, policy=policy, budget=budget,
                              score=evaluator.mean_nll(window, args.ctx, drop),
                              compressed_cells=n_prefilled - (0 if drop is None else drop.shape[2]),
                              tokens_evicted=0 if drop is None else int(drop.shape[2]),
                              seconds=time.perf_counter() - start)
                record["kv_mode"] = mode
                if policy == "observed":
                    record["observe"] = args.observe
                if mode == "per_head":
                    record["head_consensus"] = 0
                log.write(json.dumps(record) + "\n")
                log.flush()
                records.append(record)
            bar.update(1)
    if args.check:
        worst = check_against(records, args.check)
        print("largest |NLL difference| against " + args.check + ": " +
              ", ".join(f"{name} {value:.2e}" for name, value in sorted(worst.items())))
    capture.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
