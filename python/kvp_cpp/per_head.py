"""ctypes bindings of the per-head KV eviction functions of the patched llama.cpp (``llama_kvp_*`` in llama.h).

Available only when the process runs the patched library (``KVP_CPP_LLAMA=per_head``, see ``kvp_cpp.llama_build``);
every function raises ``RuntimeError`` saying what to do otherwise. ``ctx`` is a ``llama_cpp.Llama``, a
``llama_cpp._internals.LlamaContext`` or a raw ``llama_context *``.

Semantics (see the patch, ``kvp_cpp/llama_patches``): every (layer, KV head) of the cache keeps its own tokens; an
eviction removes the same number of tokens from every head, each head choosing its own, and moves K/V rows so that
all heads keep using the same cells. Positions are the original ones (no K-shift once enabled).
"""
from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from ._llama_lib import loaded_library_is_patched, require_per_head

ERRORS = {
    -1: "the context's memory cannot hold per-head state (needs a KV cache with one sequence, no ALiBi or M-RoPE, "
        "the same KV head count in every layer; with sliding-window layers only the others are per head)",
    -2: "per-head eviction is not enabled on this context (call enable() first)",
    -3: "an index or a count out of range",
    -4: "a position that the head does not hold, or the same position twice",
}

_bound = None


def available() -> bool:
    """Whether this process runs the patched llama.cpp."""
    return loaded_library_is_patched()


def _lib():
    global _bound
    if _bound is None:
        require_per_head()
        import llama_cpp

        lib = llama_cpp.llama_cpp._lib
        c_ctx, i32, pos_p = ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32)
        for name, argtypes, restype in (
            ("llama_kvp_enable", [c_ctx], i32),
            ("llama_kvp_enabled", [c_ctx], ctypes.c_bool),
            ("llama_kvp_n_layer", [c_ctx], i32),
            ("llama_kvp_n_head_kv", [c_ctx], i32),
            ("llama_kvp_layer", [c_ctx, i32], i32),
            ("llama_kvp_head_pos", [c_ctx, i32, i32, pos_p, i32], i32),
            ("llama_kvp_evict", [c_ctx, i32, pos_p], i32),
        ):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
        _bound = lib
    return _bound


def _ctx(ctx: Any) -> int:
    inner = getattr(ctx, "_ctx", None)  # llama_cpp.Llama
    if inner is not None:
        ctx = inner
    inner = getattr(ctx, "ctx", None)  # llama_cpp._internals.LlamaContext
    if inner is not None:
        ctx = inner
    address = ctypes.cast(ctx, ctypes.c_void_p).value if not isinstance(ctx, int) else ctx
    if not address:
        raise RuntimeError("null llama_context")
    return address


def _check(rc: int, what: str) -> int:
    if rc < 0:
        raise RuntimeError(f"{what}: {ERRORS.get(rc, f'error {rc}')}")
    return rc


def enable(ctx: Any) -> None:
    """Switches the context's KV cache to per-head bookkeeping (idempotent)."""
    _check(_lib().llama_kvp_enable(_ctx(ctx)), "llama_kvp_enable")


def enabled(ctx: Any) -> bool:
    return bool(_lib().llama_kvp_enabled(_ctx(ctx)))


def n_layer(ctx: Any) -> int:
    """Layers of the per-head cache (cache layer i is the i-th of them in model order, see ``layers``)."""
    return _check(_lib().llama_kvp_n_layer(_ctx(ctx)), "llama_kvp_n_layer")


def layers(ctx: Any) -> list:
    """The model layer of each cache layer: all layers, or on a model with sliding-window layers the others only."""
    lib, c = _lib(), _ctx(ctx)
    return [_check(lib.llama_kvp_layer(c, il), "llama_kvp_layer") for il in range(n_layer(ctx))]


def n_head_kv(ctx: Any) -> int:
    return _check(_lib().llama_kvp_n_head_kv(_ctx(ctx)), "llama_kvp_n_head_kv")


def head_positions(ctx: Any, il: int, ih: int, n_cells: int) -> np.ndarray:
    """The position that KV head ``ih`` of cache layer ``il`` holds in each of the first ``n_cells`` cells (-1: empty)."""
    out = np.full(n_cells, -1, dtype=np.int32)
    _check(_lib().llama_kvp_head_pos(_ctx(ctx), il, ih, out.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), n_cells),
           "llama_kvp_head_pos")
    return out


def positions(ctx: Any, n_cells: int) -> np.ndarray:
    """``[n_layer, n_head_kv, n_cells]``: every head's position per cell, -1 for empty cells."""
    nl, nh = n_layer(ctx), n_head_kv(ctx)
    return np.stack([np.stack([head_positions(ctx, il, ih, n_cells) for ih in range(nh)]) for il in range(nl)])


def cell_counts(ctx: Any) -> np.ndarray:
    """``[n_layer, n_head_kv]``: the number of cells each head uses, as the cache reports it."""
    lib, c = _lib(), _ctx(ctx)
    nl, nh = n_layer(ctx), n_head_kv(ctx)
    return np.array([[_check(lib.llama_kvp_head_pos(c, il, ih, None, 0), "llama_kvp_head_pos") for ih in range(nh)]
                     for il in range(nl)], dtype=np.int64)


def evict(ctx: Any, pos: np.ndarray) -> None:
    """Every head drops its own tokens: ``pos[il, ih, :]`` are the positions KV head ``ih`` of cache layer ``il``
    drops (the same count for every head). All or nothing: on error the cache is unchanged."""
    pos = np.ascontiguousarray(pos, dtype=np.int32)
    if pos.ndim != 3 or pos.shape[:2] != (n_layer(ctx), n_head_kv(ctx)):
        raise ValueError(f"pos must be [n_layer={n_layer(ctx)}, n_head_kv={n_head_kv(ctx)}, n_evict], got {pos.shape}")
    _check(_lib().llama_kvp_evict(_ctx(ctx), pos.shape[2], pos.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))),
           "llama_kvp_evict")
