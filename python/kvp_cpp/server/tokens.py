"""Tokenizing a conversation's prompt once, not once per turn.

Chat handlers render the whole conversation and tokenize it on every request, and llama.cpp's tokenizer takes about
12 microseconds a token: a quarter of a second per turn at 20,000 tokens, growing with the conversation. With
``special=True`` llama.cpp first splits the text at special tokens and tokenizes the pieces between them on their
own, so the tokens before a control token (``<|im_start|>``, ``<|eot_id|>``...) do not depend on what follows it. A
prompt that extends a recent one therefore reuses that one's tokens up to the last control token they share and
tokenizes only the rest. The offsets of control tokens come from the tokens' pieces; where the pieces do not spell
the text back (a tokenizer that adds a space prefix, a token that strips whitespace), no offsets are recorded and
nothing is reused.
"""
from __future__ import annotations

import ctypes
from collections import OrderedDict
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import llama_cpp
import numpy as np


@dataclass
class Tokenized:
    text: bytes
    add_bos: bool
    tokens: np.ndarray  # intc
    cut_offsets: np.ndarray  # byte offset of each control token whose tokens before it can be reused
    cut_ends: np.ndarray  # byte offset just after that control token
    cut_tokens: np.ndarray  # its index in tokens


class TokenizationCache:
    """The tokens of the last ``size`` long prompts, with their control-token cut points."""

    MIN_BYTES = 2048  # shorter prompts are tokenized whole

    def __init__(self, vocab, size: int):
        self.vocab = vocab
        self.size = max(1, int(size))
        self._entries: "OrderedDict[int, Tokenized]" = OrderedDict()
        self.reused_tokens = 0
        self.tokenized_bytes = 0
        self._piece = ctypes.create_string_buffer(256)

    def piece(self, token: int) -> bytes:
        n = llama_cpp.llama_token_to_piece(self.vocab, token, self._piece, len(self._piece), 0, True)
        return self._piece.raw[: max(n, 0)]

    def is_control(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_get_attr(self.vocab, token) & llama_cpp.LLAMA_TOKEN_ATTR_CONTROL)

    def lookup(self, text: bytes, add_bos: bool) -> Tuple[int, np.ndarray, Optional[Tokenized]]:
        """(bytes, tokens) of ``text`` already tokenized in a recent prompt, and that prompt's entry."""
        best: Tuple[int, np.ndarray, Optional[Tokenized]] = (0, np.zeros(0, dtype=np.intc), None)
        for entry in self._entries.values():
            if entry.add_bos != add_bos or not len(entry.cut_offsets):
                continue
            lo, hi = 0, len(entry.cut_offsets)  # the shared cuts are a prefix of the cuts: binary search
            while lo < hi:
                mid = (lo + hi) // 2
                if text.startswith(entry.text[: entry.cut_ends[mid]]):
                    lo = mid + 1
                else:
                    hi = mid
            if lo and entry.cut_tokens[lo - 1] > len(best[1]):
                best = (int(entry.cut_offsets[lo - 1]), entry.tokens[: entry.cut_tokens[lo - 1]], entry)
        return best

    def add(self, text: bytes, add_bos: bool, tokens: Sequence[int], start: int, n_reused: int,
            base: Optional[Tokenized]) -> None:  # fmt: skip
        """Records ``tokens`` of ``text``, whose first ``n_reused`` came from ``base`` (the text before ``start``)."""
        offsets, ends, indices = [], [], []
        if base is not None:
            keep = int(np.searchsorted(base.cut_tokens, n_reused))  # base's cuts before the reused part's end
            offsets, ends, indices = (base.cut_offsets[:keep].tolist(), base.cut_ends[:keep].tolist(),
                                      base.cut_tokens[:keep].tolist())  # fmt: skip
        offset = start
        for index in range(n_reused, len(tokens)):
            token = int(tokens[index])
            piece = self.piece(token)
            if index == 0 and add_bos and not text.startswith(piece):
                continue  # a BOS the tokenizer added: not in the text
            if text[offset : offset + len(piece)] != piece:
                break  # the pieces do not spell the text: no cut points past here
            if self.is_control(token):
                offsets.append(offset)
                ends.append(offset + len(piece))
                indices.append(index)
            offset += len(piece)
        entry = Tokenized(text, add_bos, np.asarray(tokens, dtype=np.intc), np.asarray(offsets, dtype=np.int64),
                          np.asarray(ends, dtype=np.int64), np.asarray(indices, dtype=np.int64))  # fmt: skip
        if base is not None and text.startswith(base.text):
            self._entries.pop(id(base), None)  # superseded by its extension
        self._entries[id(entry)] = entry
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    @property
    def nbytes(self) -> int:
        return sum(len(e.text) + e.tokens.nbytes + 3 * e.cut_offsets.nbytes for e in self._entries.values())


def tokenize_with_cache(cache: TokenizationCache, tokenize, text: bytes, add_bos: bool) -> List[int]:
    """``tokenize(text, add_bos, special=True)``, reusing the tokens of a recent prompt that ``text`` extends."""
    start, reused, base = cache.lookup(text, add_bos)
    rest = tokenize(text[start:], add_bos and start == 0, True)
    tokens = reused.tolist() + list(rest)
    cache.reused_tokens += len(reused)
    cache.tokenized_bytes += len(text) - start
    cache.add(text, add_bos, tokens, start, len(reused), base)
    return tokens
