"""Capture named graph nodes (post-RoPE Q, K, V, attention weights, attention outputs) from llama.cpp decodes.

For offline work: training traces, and checking what is recomputed from Q/K/V against llama.cpp's own tensors.
The inference path never uses it.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, Iterable, List, Optional, Sequence

import numpy as np
import llama_cpp

from . import _core
from .llama import recreate_context

# Nodes laid out as [dim, heads, tokens] in ggml, whose per-ubatch captures concatenate along tokens.
PER_TOKEN_NODES = ("Qcur", "Kcur", "Vcur", "kqv_out")


class TensorCapture:
    """A llama.cpp context whose decodes copy out the requested nodes of the given layers (default: all)."""

    def __init__(self, model_path: str, names: Sequence[str] = ("Qcur", "Kcur", "Vcur"),
                 layers: Optional[Iterable[int]] = None, n_ctx: int = 4096, n_batch: int = 512,
                 flash_attn: bool = False, n_threads: Optional[int] = None):
        self.names = tuple(names)
        self.llm = llama_cpp.Llama(model_path, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, flash_attn=flash_attn,
                                   n_threads=n_threads, n_threads_batch=n_threads, verbose=False)
        self.recorder = _core.Recorder(list(self.names), sorted(layers) if layers is not None else [])
        recreate_context(self.llm, callback_address=self.recorder.callback_address, user_data=self.recorder.address)

    def run(self, tokens: Sequence[int]) -> Dict[str, Dict[int, object]]:
        """Decodes ``tokens`` from an empty cache. Returns {name: {layer: array}}: for Qcur/Kcur/Vcur an array
        (tokens, heads, dim), for kqv_out (tokens, n_embd), for any other node the list of per-ubatch captures in
        numpy axis order (ne3, ne2, ne1, ne0)."""
        self.llm.reset()
        self.recorder.take()
        self.llm.eval(list(tokens))
        chunks: Dict[str, Dict[int, List[np.ndarray]]] = defaultdict(lambda: defaultdict(list))
        for name, layer, array in self.recorder.take():
            chunks[name][layer].append(array)
        out: Dict[str, Dict[int, object]] = {}
        for name, by_layer in chunks.items():
            if name in PER_TOKEN_NODES:
                # (1, tokens, heads, dim) or (1, 1, tokens, n_embd) per ubatch
                out[name] = {layer: np.concatenate([a.reshape((-1,) + a.shape[-2:]) if name != "kqv_out"
                                                    else a.reshape(-1, a.shape[-1]) for a in arrays], axis=0)
                             for layer, arrays in by_layer.items()}
            else:
                out[name] = dict(by_layer)
        return out

    def close(self) -> None:
        self.llm.close()
