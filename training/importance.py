"""Importance targets: the attention each cached token receives from the next tokens (docs/traces.md).

For a cut c (the cache holds tokens 0..c-1) and future queries j = c .. c+f-1:
    I_i = sum_j max_{h in group(g)} softmax_{i' <= j}(q_j^h . k_i'^g * scale)[i]        for i < c,
the causal softmax over the uncompressed keys with llama.cpp's scale, max over the query heads of KV head g's
GQA group. Query head h reads KV head h // (n_head / n_head_kv), as in llama.cpp. In a sliding-window layer
(Gemma 3's local layers) query j sees only keys i with j - i < window, as llama.cpp's standard SWA mask.
"""
from __future__ import annotations

from typing import Optional

import numpy as np


def causal_attention(q: np.ndarray, k: np.ndarray, scale: float, first_query: int,
                     window: Optional[int] = None) -> np.ndarray:
    """Softmax attention of queries at positions first_query.. over keys 0..(own position) (within `window`).

    q: (m, n_head, d) for positions first_query .. first_query+m-1; k: (n, n_head_kv, d) with n >= first_query+m.
    Returns (m, n_head, n) float64 weights, zero for keys after each query.
    """
    m, n_head, _ = q.shape
    n, n_head_kv, _ = k.shape
    group = n_head // n_head_kv
    k_per_head = np.repeat(k.astype(np.float64), group, axis=1)                       # (n, n_head, d)
    logits = np.einsum("mhd,nhd->mhn", q.astype(np.float64), k_per_head) * scale
    key_pos = np.arange(n)[None, None, :]
    query_pos = (first_query + np.arange(m))[:, None, None]
    visible = key_pos <= query_pos
    if window is not None:
        visible &= query_pos - key_pos < window
    logits = np.where(visible, logits, -np.inf)
    logits -= logits.max(axis=-1, keepdims=True)
    weights = np.exp(logits)
    return weights / weights.sum(axis=-1, keepdims=True)


def received(weights: np.ndarray, n_head_kv: int) -> np.ndarray:
    """(n_head_kv, n) attention each key receives: max over each KV head's GQA group, summed over the queries.
    weights: (m, n_head, n) from causal_attention."""
    m, n_head, n = weights.shape
    return weights.reshape(m, n_head_kv, n_head // n_head_kv, n).max(axis=2).sum(axis=0)


def importance(q: np.ndarray, k: np.ndarray, cut: int, n_future: int, scale: float,
               window: Optional[int] = None) -> np.ndarray:
    """(n_head_kv, cut) importance of the cached tokens 0..cut-1 from queries cut..cut+n_future-1."""
    weights = causal_attention(q[cut:cut + n_future], k[:cut + n_future], scale, cut, window)  # (f, n_head, cut+f)
    return received(weights[:, :, :cut], k.shape[1])


def attention_output(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float,
                     window: Optional[int] = None) -> np.ndarray:
    """Full causal attention output (tokens, n_head, dv), to check the recomputation against llama.cpp's kqv_out."""
    weights = causal_attention(q, k, scale, 0, window)                                        # (n, n_head, n)
    group = q.shape[1] // k.shape[1]
    v_per_head = np.repeat(v.astype(np.float64), group, axis=1)                        # (n, n_head, dv)
    return np.einsum("mhn,nhd->mhd", weights, v_per_head)
