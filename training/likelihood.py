"""The model's own likelihood of an answer read from a (compressed) cache: the end-to-end measure of a kept set.

Used by training.e2e (the reward of a sampled kept set) and benchmarks/kept_set_criteria.py (which measure of a kept
set predicts its task score). numpy and llama-cpp-python only.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["mean_nll", "decode_answer_nll", "AnswerLikelihood"]


def mean_nll(logits: np.ndarray, targets: Sequence[int]) -> float:
    """Mean −log softmax(logits[i])[targets[i]] over the rows."""
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    log_probs = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return float(-log_probs[np.arange(len(targets)), np.asarray(targets)].mean())


def decode_answer_nll(llm, tail: Sequence[int], answer: Sequence[int], after_decode=None) -> float:
    """Decode ``tail`` (the prompt's last token, then the answer but its last token) into ``llm``'s cache one token at
    a time and return the answer's mean negative log-likelihood. One token per decode, so that no logits are computed
    for anything else (a 2K-token batch with every row's logits costs more than the model)."""
    import llama_cpp

    n_vocab = llm.n_vocab()
    rows = []
    for token in tail:
        llm.eval([token])
        rows.append(np.ctypeslib.as_array(llama_cpp.llama_get_logits(llm.ctx), shape=(n_vocab,)).astype(np.float64))
        if after_decode:
            after_decode()
    return mean_nll(np.stack(rows), answer)


class AnswerLikelihood:
    """A llama.cpp context that scores an answer after removing chosen tokens of a prefilled prompt.

    ``llm`` is a llama_cpp.Llama; ``after_decode`` (optional) runs after each decode, e.g. to drain a capture."""

    def __init__(self, llm, after_decode=None):
        self.llm = llm
        self.after_decode = after_decode

    def prefill(self, tokens: Sequence[int]):
        """Decode ``tokens`` from an empty cache and return the context's state."""
        self.llm.reset()
        self.llm.eval(list(tokens))
        if self.after_decode:
            self.after_decode()
        return self.llm.save_state()

    def nll(self, state, kept: np.ndarray, tail: Sequence[int], answer: Sequence[int]) -> float:
        """The answer's mean −log-likelihood when the prefilled tokens where ``kept`` is False are removed
        (``llama_memory_seq_rm``, the others keep their original positions, as the engine evicts) and ``tail`` is
        decoded after them. The state is loaded first, so every call starts from the same prefill."""
        import llama_cpp

        self.llm.load_state(state)
        memory = llama_cpp.llama_get_memory(self.llm.ctx)
        evicted = np.flatnonzero(~np.asarray(kept, bool))
        if evicted.size:  # contiguous runs, one call each
            breaks = np.flatnonzero(np.diff(evicted) > 1)
            starts = np.concatenate([[evicted[0]], evicted[breaks + 1]])
            ends = np.concatenate([evicted[breaks], [evicted[-1]]]) + 1
            for start, end in zip(starts, ends):
                if not llama_cpp.llama_memory_seq_rm(memory, 0, int(start), int(end)):
                    raise RuntimeError(f"llama_memory_seq_rm refused positions {start}..{end - 1}")
        return decode_answer_nll(self.llm, tail, answer, self.after_decode)

    def nll_per_head(self, state, kept: np.ndarray, tail: Sequence[int], answer: Sequence[int]) -> float:
        """As ``nll``, on a context with per-head eviction enabled (``kvp_cpp.per_head``, the patched llama.cpp):
        KV head h of cache layer l keeps the prefilled tokens where ``kept[l, h]`` is True, every head as many, and
        drops the others with ``llama_kvp_evict``. ``state`` must be a save made before any eviction."""
        import llama_cpp
        from kvp_cpp import per_head

        kept = np.asarray(kept, bool)
        n_layer, n_head = per_head.n_layer(self.llm), per_head.n_head_kv(self.llm)
        if kept.ndim != 3 or kept.shape[:2] != (n_layer, n_head):
            raise ValueError(f"kept must be [n_layer={n_layer}, n_head_kv={n_head}, tokens], got {kept.shape}")
        counts = kept.sum(-1)
        if not (counts == counts.flat[0]).all():
            raise ValueError(f"every head must keep as many tokens; they keep {counts.min()}..{counts.max()}")
        # A whole-state load puts the cells back and gives every head each cell's position (see the patch's
        # llama_kvp_set_head_pos): the prefill's, as long as the save preceded any eviction.
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.llm.ctx), True)
        self.llm.load_state(state)
        n_tokens = kept.shape[2]
        if not (per_head.positions(self.llm, n_tokens) == np.arange(n_tokens)).all():
            raise RuntimeError("after the state load the heads do not hold the prefilled positions 0 .. n - 1; "
                               "was the state saved after an eviction?")
        n_evict = n_tokens - int(counts.flat[0])
        if n_evict:
            per_head.evict(self.llm, np.nonzero(~kept)[2].reshape(n_layer, n_head, n_evict).astype(np.int32))
        return decode_answer_nll(self.llm, tail, answer, self.after_decode)
