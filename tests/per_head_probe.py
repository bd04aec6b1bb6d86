"""Runs one per-head scenario in a fresh process and prints its result as JSON (used by test_per_head.py).

A process loads one libllama for good, so every comparison between the stock and the patched library runs each in
its own process: ``KVP_CPP_LLAMA=per_head`` (patched) or unset (stock) is set by the caller.

    python per_head_probe.py SCENARIO '{"json": "args"}'
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import struct
import sys

import numpy as np

import kvp_cpp
import llama_cpp
from kvp_cpp import _llama_lib, per_head

from conftest import gemma_model_path  # the probe runs as a script from tests/

PROMPT = ("The lighthouse keeper counted the ships every night. On Monday there were seven, on Tuesday nine, "
          "and on Wednesday a storm kept every boat in the harbour. The keeper wrote the numbers in a blue "
          "notebook and hid it under the stairs. Question: where did the keeper hide the notebook? Answer:")


def make_llama(n_ctx=512, flash_attn=True, n_batch=512, verbose=False):
    return llama_cpp.Llama(kvp_cpp.default_model_path(), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch,
                           flash_attn=flash_attn, seed=0, verbose=verbose, n_threads=2)


def tokens_of(llm, text):
    return llm.tokenize(text.encode(), add_bos=True)


def decode(llm, tokens, n_past):
    """One llama_decode of ``tokens`` at positions n_past.., logits of the last; returns those logits (a copy)."""
    batch = llama_cpp._internals.LlamaBatch(n_tokens=max(len(tokens), 1), embd=0, n_seq_max=1, verbose=False)
    batch.set_batch(tokens, n_past=n_past, logits_all=False)
    rc = llama_cpp.llama_decode(llm._ctx.ctx, batch.batch)
    if rc != 0:
        raise RuntimeError(f"llama_decode returned {rc}")
    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, len(tokens) - 1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy()


def greedy(llm, prompt_tokens, n_new, chunk=None, enable_at=None):
    """Greedy decoding through llama_decode: the generated tokens and a SHA-256 of every logits vector seen."""
    h = hashlib.sha256()
    n_past = 0
    chunk = chunk or len(prompt_tokens)
    logits = None
    for start in range(0, len(prompt_tokens), chunk):
        if enable_at is not None and start >= enable_at and not per_head.enabled(llm):
            per_head.enable(llm)
        part = prompt_tokens[start:start + chunk]
        logits = decode(llm, part, n_past)
        n_past += len(part)
    out = []
    for _ in range(n_new):
        h.update(logits.tobytes())
        tok = int(np.argmax(logits))
        out.append(tok)
        logits = decode(llm, [tok], n_past)
        n_past += 1
    h.update(logits.tobytes())
    return out, h.hexdigest()


def state_rows(llm):
    """The used cells' K and V rows from llama.cpp's own sequence state (llama_state_seq_get_data).

    Layout (src/llama-context.cpp, src/llama-kv-cache.cpp state_write): u32 magic, i32 seq_id, u32 n_stream;
    u32 cell_count; per cell i32 pos, u32 n_seq_id, n_seq_id x i32; u32 v_trans, u32 n_layer; per layer i32 type,
    u64 row bytes, cell_count rows (K); then V the same way, or, transposed, per layer i32 type, u32 element bytes,
    u32 n_embd_v_gqa and n_embd_v_gqa runs of cell_count elements. Returns (positions, K [L, cells, row bytes],
    V [L, cells, row bytes]) with V rows put back in cell-major order."""
    ctx = llm._ctx.ctx
    size = llama_cpp.llama_state_seq_get_size(ctx, 0)
    buf = (ctypes.c_uint8 * size)()
    n = llama_cpp.llama_state_seq_get_data(ctx, buf, size, 0)
    data = memoryview(bytes(buf[:n]))
    _, _, n_stream, n_cells = struct.unpack_from("<IiII", data, 0)
    off = 16
    pos = []
    for _ in range(n_cells):
        p, n_seq = struct.unpack_from("<iI", data, off)
        off += 8 + 4 * n_seq
        pos.append(p)
    v_trans, n_layer = struct.unpack_from("<II", data, off)
    off += 8
    ks, vs = [], []
    for _ in range(n_layer):
        _, row = struct.unpack_from("<iQ", data, off)
        off += 12
        ks.append(np.frombuffer(data[off:off + row * n_cells], dtype=np.uint8).reshape(n_cells, row))
        off += row * n_cells
    for _ in range(n_layer):
        if not v_trans:
            _, row = struct.unpack_from("<iQ", data, off)
            off += 12
            vs.append(np.frombuffer(data[off:off + row * n_cells], dtype=np.uint8).reshape(n_cells, row))
            off += row * n_cells
        else:
            _, el, n_embd = struct.unpack_from("<iII", data, off)
            off += 12
            raw = np.frombuffer(data[off:off + el * n_cells * n_embd], dtype=np.uint8).reshape(n_embd, n_cells, el)
            vs.append(np.ascontiguousarray(raw.transpose(1, 0, 2)).reshape(n_cells, n_embd * el))
            off += el * n_cells * n_embd
    return np.array(pos), np.stack(ks), np.stack(vs)


def head_rows(rows, n_head):
    """[L, cells, row bytes] -> [L, n_head, cells, head bytes]."""
    L, C, B = rows.shape
    return rows.reshape(L, C, n_head, B // n_head).transpose(0, 2, 1, 3)


def snapshot(llm, n_cells):
    """Every head's positions per cell [L, H, cells] and the used cells' K and V rows (ascending cell order)."""
    _, k, v = state_rows(llm)
    return per_head.positions(llm, n_cells), k, v


def check_rows_follow_positions(llm, before, n_cells):
    """Every (layer, head, cell) row holds the K and V that the same head had for the same position before;
    returns the number of rows that do not, after checking that all heads use the same cells."""
    hp0, k0, v0 = before
    hp1, k1, v1 = snapshot(llm, n_cells)
    L, H = hp1.shape[:2]
    used0 = np.flatnonzero(hp0[0, 0] >= 0)
    used1 = np.flatnonzero(hp1[0, 0] >= 0)
    assert all((np.flatnonzero(hp1[l, h] >= 0) == used1).all() for l in range(L) for h in range(H))
    k0h, v0h, k1h, v1h = (head_rows(r, H) for r in (k0, v0, k1, v1))
    bad = 0
    for l in range(L):
        for h in range(H):
            index0 = {int(hp0[l, h, c]): j for j, c in enumerate(used0)}
            for j, c in enumerate(used1):
                i = index0[int(hp1[l, h, c])]
                bad += int(not (np.array_equal(k1h[l, h, j], k0h[l, h, i]) and
                                np.array_equal(v1h[l, h, j], v0h[l, h, i])))
    return bad


def scenario_greedy(args):
    """Greedy decoding for each entry of args["enable_at"] (null: per-head mode never enabled)."""
    results = []
    for enable_at in args.get("enable_at", [None]):
        llm = make_llama(n_ctx=args.get("n_ctx", 512), flash_attn=args["flash_attn"])
        toks = tokens_of(llm, PROMPT * args.get("repeat", 1))
        out, digest = greedy(llm, toks, args["n_new"], chunk=args.get("chunk"), enable_at=enable_at)
        results.append({"enable_at": enable_at, "tokens": out, "logits_sha256": digest, "n_prompt": len(toks),
                        "per_head_enabled": per_head.enabled(llm) if _llama_lib.loaded_library_is_patched() else False})
        llm.close()
    return {"runs": results, "patched": _llama_lib.loaded_library_is_patched(),
            "lib": str(llama_cpp.llama_cpp._base_path)}


def scenario_planted(args):
    """Each head keeps the sink and recent tokens plus one planted token of its own, and drops the rest."""
    n_ctx, sink, recent = 512, 4, 16
    llm = make_llama(n_ctx=n_ctx, flash_attn=args["flash_attn"])
    per_head.enable(llm)
    toks = tokens_of(llm, PROMPT * 4)[:200]
    logits = decode(llm, toks, 0)
    n = len(toks)
    before = snapshot(llm, n_ctx)
    L, H = per_head.n_layer(llm), per_head.n_head_kv(llm)
    middle = np.arange(sink, n - recent)
    rng = np.random.default_rng(args.get("seed", 0))
    planted = rng.choice(middle, size=(L, H), replace=L * H > len(middle))
    drop = np.stack([np.stack([middle[middle != planted[l, h]] for h in range(H)]) for l in range(L)])
    per_head.evict(llm, drop)
    hp = per_head.positions(llm, n_ctx)
    kept_ok = all(sorted(hp[l, h][hp[l, h] >= 0].tolist()) ==
                  sorted(list(range(sink)) + [int(planted[l, h])] + list(range(n - recent, n)))
                  for l in range(L) for h in range(H))
    bad_rows = check_rows_follow_positions(llm, before, n_ctx)
    counts = per_head.cell_counts(llm)
    shared_pos = state_rows(llm)[0]
    # decoding goes on over the per-head cache
    out, n_past = [], n
    for _ in range(8):
        tok = int(np.argmax(logits))
        out.append(tok)
        logits = decode(llm, [tok], n_past)
        n_past += 1
    return {"kept_ok": kept_ok, "bad_rows": bad_rows, "counts": counts.tolist(), "n_prompt": n,
            "n_distinct_planted": int(len(np.unique(planted))), "shared_cells": int(len(shared_pos)),
            "shared_pos_max": int(shared_pos.max()), "finite": bool(np.isfinite(logits).all()),
            "counts_after_decode": per_head.cell_counts(llm).tolist(), "generated": out}


def scenario_answer_likelihood(args):
    """training.likelihood.AnswerLikelihood on a per-head context: the answer's NLL with nothing removed, with one
    kept set removed by seq_rm and by per-head eviction of the same set in every head, and with every head keeping
    its own set (twice, from the same saved prefill); then with nothing removed again."""
    import pathlib

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from training.likelihood import AnswerLikelihood

    llm = make_llama(n_ctx=512)
    per_head.enable(llm)
    scorer = AnswerLikelihood(llm)
    prompt = tokens_of(llm, PROMPT * 3)
    answer = llm.tokenize(b" under the stairs", add_bos=False)
    tail, n = prompt[-1:] + answer[:-1], len(prompt) - 1
    state = scorer.prefill(prompt[:-1])
    L, H = per_head.n_layer(llm), per_head.n_head_kv(llm)
    rng = np.random.default_rng(0)
    middle = np.arange(4, n - 16)
    n_drop = len(middle) // 2
    shared_kept = np.ones(n, bool)
    shared_kept[rng.choice(middle, n_drop, replace=False)] = False
    own_kept = np.ones((L, H, n), bool)
    for l in range(L):
        for h in range(H):
            own_kept[l, h, rng.choice(middle, n_drop, replace=False)] = False
    result = {"n_prompt": n, "n_kept": n - n_drop, "n_tail": len(tail), "n_layer": L, "n_head": H,
              "full": scorer.nll(state, np.ones(n, bool), tail, answer),
              "full_per_head": scorer.nll_per_head(state, np.ones((L, H, n), bool), tail, answer),
              "same_seq_rm": scorer.nll(state, shared_kept, tail, answer),
              "same_per_head": scorer.nll_per_head(state, np.broadcast_to(shared_kept, (L, H, n)), tail, answer),
              "own": [scorer.nll_per_head(state, own_kept, tail, answer) for _ in range(2)]}
    result["counts_after_own"] = per_head.cell_counts(llm).tolist()
    result["full_per_head_again"] = scorer.nll_per_head(state, np.ones((L, H, n), bool), tail, answer)
    unequal = own_kept.copy()
    unequal[0, 0, middle] = True
    try:
        scorer.nll_per_head(state, unequal, tail, answer)
        result["unequal_error"] = None
    except ValueError as e:
        result["unequal_error"] = str(e)
    return result


def scenario_budget(args):
    """A stream longer than the cache: before each chunk every head drops its own random tokens to make room."""
    n_ctx, chunk, recent = args["n_ctx"], args["chunk"], 8
    llm = make_llama(n_ctx=n_ctx, flash_attn=args["flash_attn"], n_batch=chunk)
    n_cells = llama_cpp.llama_n_ctx(llm._ctx.ctx)
    per_head.enable(llm)
    toks = tokens_of(llm, PROMPT * args["repeat"])
    L, H = per_head.n_layer(llm), per_head.n_head_kv(llm)
    rng = np.random.default_rng(1)
    n_past, max_count, row_checks, steps = 0, 0, 0, 0
    evictions = 0
    for start in range(0, len(toks), chunk):
        part = toks[start:start + chunk]
        used = int(per_head.cell_counts(llm)[0, 0])
        need = used + len(part) - n_cells
        if need > 0:
            hp = per_head.positions(llm, n_cells)
            drop = np.empty((L, H, need), dtype=np.int32)
            for l in range(L):
                for h in range(H):
                    held = hp[l, h][(hp[l, h] >= 0) & (hp[l, h] < n_past - recent)]
                    drop[l, h] = rng.choice(held, size=need, replace=False)
            before = snapshot(llm, n_cells) if evictions % 8 == 0 else None
            per_head.evict(llm, drop)
            evictions += 1
            if before is not None:
                row_checks += 1
                assert check_rows_follow_positions(llm, before, n_cells) == 0
            hp = per_head.positions(llm, n_cells)
            for l in range(L):
                for h in range(H):
                    assert not np.isin(drop[l, h], hp[l, h]).any()
        logits = decode(llm, part, n_past)
        n_past += len(part)
        counts = per_head.cell_counts(llm)
        assert (counts == counts[0, 0]).all()
        max_count = max(max_count, int(counts.max()))
        steps += 1
    shared_pos = state_rows(llm)[0]
    return {"n_tokens": n_past, "n_cells": n_cells, "max_count": max_count, "evictions": evictions,
            "row_checks": row_checks, "final_counts": per_head.cell_counts(llm).tolist(),
            "shared_cells": int(len(shared_pos)), "shared_pos_max": int(shared_pos.max()),
            "finite": bool(np.isfinite(logits).all())}


class GgmlTensor(ctypes.Structure):
    """The head of ggml.h's struct ggml_tensor (this llama.cpp: GGML_MAX_SRC 10, GGML_MAX_NAME 64)."""
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64)]


def capture_attention_output(llm, layer=0):
    """Re-creates llm's context with an eval callback that records the attention output of one layer
    (``kqv_out-<layer>``, F32 [n_embd, n_tokens] on the CPU) at each decode; returns the list it appends to."""
    from kvp_cpp.llama import recreate_context

    target, seen = f"kqv_out-{layer}".encode(), []

    @llama_cpp.ggml_backend_sched_eval_callback
    def callback(tensor, ask, user_data):
        t = ctypes.cast(tensor, ctypes.POINTER(GgmlTensor)).contents
        if ask:
            return t.name == target
        if t.name == target:
            n = t.ne[0] * t.ne[1]
            seen.append(np.ctypeslib.as_array(ctypes.cast(t.data, ctypes.POINTER(ctypes.c_float)), shape=(n,)).copy())
        return True

    llm._kvp_probe_callback = callback  # outlives the context
    recreate_context(llm, callback_address=ctypes.cast(callback, ctypes.c_void_p).value)
    return seen


def scenario_order(args):
    """The same per-head token sets reached in two ways, A then B or A+B at once, leave the rows in different
    cells. Layer 0's attention output (its input is the token embedding, the same in every run) must then agree
    up to the order in which attention visits the cells; a run without eviction is the control. Later layers are
    not compared: there a rounding difference is amplified by the 8-bit quantisation of activations."""
    n_ctx, n_new = 512, 16
    rng = np.random.default_rng(args.get("seed", 3))
    runs = {}
    for how in ("none", "a_then_b", "at_once"):
        llm = make_llama(n_ctx=n_ctx, flash_attn=args["flash_attn"])
        seen = capture_attention_output(llm, layer=0)
        per_head.enable(llm)
        toks = tokens_of(llm, PROMPT * 4)[:200]
        n = len(toks)
        L, H = per_head.n_layer(llm), per_head.n_head_kv(llm)
        if how == "none":
            middle = np.arange(4, n - 16, dtype=np.int32)
            drops = np.stack([np.stack([rng.permutation(middle)[:80] for _ in range(H)]) for _ in range(L)])
            forced = [int(t) for t in rng.integers(100, llm.n_vocab() - 100, size=n_new)]
        decode(llm, toks, 0)
        if how == "a_then_b":
            per_head.evict(llm, drops[:, :, :40])
            per_head.evict(llm, drops[:, :, 40:])
        elif how == "at_once":
            per_head.evict(llm, drops)
        hp = per_head.positions(llm, n_ctx)
        del seen[:]
        argmaxes = []
        for i in range(n_new):
            argmaxes.append(int(np.argmax(decode(llm, [forced[i]], n + i))))
        runs[how] = {"hp": hp, "attn0": np.stack(seen), "argmax": argmaxes}
        llm.close()
    a, b, none = runs["a_then_b"], runs["at_once"], runs["none"]
    L, H = a["hp"].shape[:2]
    sets = lambda hp, l, h: sorted(hp[l, h][hp[l, h] >= 0].tolist())
    same_sets = all(sets(a["hp"], l, h) == sets(b["hp"], l, h) for l in range(L) for h in range(H))
    expected = all(set(sets(a["hp"], l, h)) == set(range(len(toks))) - set(drops[l, h].tolist())
                   for l in range(L) for h in range(H))
    moved_heads = int(sum(not np.array_equal(a["hp"][l, h], b["hp"][l, h]) for l in range(L) for h in range(H)))
    scale = float(np.max(np.abs(a["attn0"])))
    return {"same_sets": same_sets, "expected_sets": expected, "heads_laid_out_differently": moved_heads,
            "n_captured": int(a["attn0"].shape[0]),
            "argmax_same": a["argmax"] == b["argmax"],
            "rel_diff": float(np.max(np.abs(a["attn0"] - b["attn0"]))) / scale,
            "control_rel_diff": float(np.max(np.abs(a["attn0"] - none["attn0"]))) / scale}


def scenario_seq_rm(args):
    n_ctx = 512
    llm = make_llama(n_ctx=n_ctx, flash_attn=True)
    per_head.enable(llm)
    toks = tokens_of(llm, PROMPT * 4)[:160]
    decode(llm, toks, 0)
    L, H = per_head.n_layer(llm), per_head.n_head_kv(llm)
    # head (0, 0) drops positions 100..129, every other head 10..39
    drop = np.tile(np.arange(10, 40, dtype=np.int32), (L, H, 1))
    drop[0, 0] = np.arange(100, 130)
    per_head.evict(llm, drop)
    mem = llama_cpp.llama_get_memory(llm._ctx.ctx)
    unequal = bool(llama_cpp.llama_memory_seq_rm(mem, 0, 0, 50))       # head (0,0) holds 50 there, others 20
    counts_after_refusal = per_head.cell_counts(llm).tolist()
    tail = bool(llama_cpp.llama_memory_seq_rm(mem, 0, 150, -1))        # every head holds 150..159
    counts_after_tail = per_head.cell_counts(llm).tolist()
    pos_max = int(llama_cpp.llama_memory_seq_pos_max(mem, 0))
    bad_evict = None
    try:
        per_head.evict(llm, np.tile(np.array([10], dtype=np.int32), (L, H, 1)))  # already dropped by most heads
    except RuntimeError as e:
        bad_evict = str(e)
    counts_after_bad = per_head.cell_counts(llm).tolist()
    everything = bool(llama_cpp.llama_memory_seq_rm(mem, 0, -1, -1))
    return {"unequal": unequal, "counts_after_refusal": counts_after_refusal, "tail": tail,
            "counts_after_tail": counts_after_tail, "pos_max": pos_max, "bad_evict": bad_evict,
            "counts_after_bad": counts_after_bad, "everything": everything,
            "counts_after_clear": per_head.cell_counts(llm).tolist()}


def scenario_refused(args):
    """A context holding two sequences cannot go per-head."""
    llm = make_llama(n_ctx=512)
    params = llm.context_params
    params.n_seq_max = 2
    ctx2 = llama_cpp._internals.LlamaContext(model=llm._model, params=params, verbose=False)
    try:
        per_head.enable(ctx2)
        return {"error": None}
    except RuntimeError as e:
        return {"error": str(e)}
    finally:
        ctx2.close()


def scenario_kv_bytes(args):
    """KV buffer sizes as llama.cpp logs them, for a per-head and a shared context of the same size."""
    msgs = []

    @llama_cpp.llama_log_callback
    def log(level, text, user_data):
        msgs.append(text.decode(errors="replace"))

    llama_cpp.llama_log_set(log, None)
    llm = make_llama(n_ctx=args["n_ctx"], verbose=True)
    lines = [m.strip() for m in msgs if "KV buffer size" in m or "llama_kv_cache: size" in m]
    if args.get("per_head"):
        per_head.enable(llm)
    toks = tokens_of(llm, PROMPT)
    decode(llm, toks, 0)
    from llama_cpp import _logger
    llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))  # llama-cpp-python's own again
    return {"lines": lines, "n_cells": int(llama_cpp.llama_n_ctx(llm._ctx.ctx)),
            "enabled": per_head.enabled(llm) if _llama_lib.loaded_library_is_patched() else False}


def scenario_engine(args):
    """kvp-cpp's own shared-cell engine (a scoring policy, a prompt 4x the budget): its output and counters."""
    llm = kvp_cpp.Llama(kvp_cpp.default_model_path(), n_ctx=256, kv_policy=args["policy"], flash_attn=True,
                        seed=0, verbose=False, n_threads=2)
    out = llm.create_completion(PROMPT * 16, max_tokens=16, temperature=0.0)
    stats = llm.kv_stats()
    return {"text": out["choices"][0]["text"], "tokens_evicted": stats["tokens_evicted"],
            "cells_used": stats["cells_used"], "patched": _llama_lib.loaded_library_is_patched()}


def scenario_engine_per_head(args):
    """kvp_cpp.Llama(kv_mode=...) on a prompt ~4x the budget: text, counters, and every head's cells from the cache."""
    budget = args.get("budget", 256)
    mode = args.get("kv_mode", "per_head") if args["policy"] else "shared"
    llm = kvp_cpp.Llama(kvp_cpp.default_model_path(), n_ctx=budget, kv_policy=args["policy"], kv_mode=mode,
                        kv_position_mode=args.get("position_mode"), flash_attn=True, seed=0, verbose=False,
                        n_threads=2, kv_head_consensus=args.get("consensus"),  # absent: the default
                        kv_evict_unit=args.get("evict_unit", "token") if args["policy"] else "token")
    out = llm.create_completion(PROMPT * args.get("repeat", 16), max_tokens=16, temperature=0.0)
    result = {"text": out["choices"][0]["text"], "n_cells": int(llama_cpp.llama_n_ctx(llm._ctx.ctx))}
    if args["policy"]:
        stats = llm.kv_stats()
        result.update(tokens_evicted=stats["tokens_evicted"], cells_used=stats["cells_used"],
                      head_consensus=llm._kvp_engine.head_consensus)
    if mode == "per_head":
        hp = per_head.positions(llm, result["n_cells"])
        L, H = hp.shape[:2]
        counts = per_head.cell_counts(llm)
        result.update(counts=sorted({int(c) for c in counts.ravel()}),
                      n_distinct_sets=len({np.sort(hp[l, h][hp[l, h] >= 0]).tobytes() for l in range(L) for h in range(H)}),
                      max_pos=int(hp.max()))
    return result


def scenario_gemma(args):
    """Gemma 3 (sliding-window layers): greedy text of a prompt, kvp_cpp.Llama in either mode (or stock
    llama-cpp-python without a policy), and in per-head mode every head's positions read from the cache, and what
    a seq_rm that the heads cannot do leaves in both caches."""
    budget, n_prompt = args["budget"], args["n_prompt"]
    kwargs = dict(n_ctx=budget, flash_attn=True, seed=0, verbose=False, n_threads=2)
    if args.get("policy"):
        llm = kvp_cpp.Llama(gemma_model_path(), kv_policy=args["policy"], kv_mode=args.get("kv_mode", "per_head"),
                            kv_head_consensus=args.get("consensus"), **kwargs)
    else:
        llm = llama_cpp.Llama(gemma_model_path(), **kwargs)
    text = " ".join(f"Item {i}: the {w} is {c}." for i, (w, c) in enumerate(
        [("grass", "green"), ("sky", "blue"), ("sun", "yellow"), ("snow", "white")] * 200))
    tokens = llm.tokenize(text.encode())[:n_prompt]
    out = llm.create_completion(tokens, max_tokens=12, temperature=0.0)
    result = {"text": out["choices"][0]["text"], "patched": _llama_lib.loaded_library_is_patched()}
    if not args.get("policy"):
        return result
    stats = llm.kv_stats()
    result.update(tokens_evicted=stats["tokens_evicted"], cells_used=stats["cells_used"])
    if args.get("kv_mode", "per_head") != "per_head":
        return result
    hp = per_head.positions(llm, budget)
    held = [sorted(int(p) for p in hp[l, h] if p >= 0) for l in range(hp.shape[0]) for h in range(hp.shape[1])]
    n_seen = int(hp.max()) + 1
    result.update(layers=per_head.layers(llm), n_head_kv=per_head.n_head_kv(llm),
                  counts=per_head.cell_counts(llm).ravel().tolist(), n_distinct_sets=len({tuple(h) for h in held}),
                  window_held=all(set(range(n_seen - 512, n_seen)) <= set(h) for h in held), n_seen=n_seen)
    # [0, cut) holds different numbers of tokens per head, and some of the sliding-window cache's tokens: the
    # seq_rm is refused, and the window cache (whose oldest token llama.cpp reports) must keep them too
    mem = llama_cpp.llama_get_memory(llm._ctx.ctx)
    window_oldest = llama_cpp.llama_memory_seq_pos_min(mem, 0)
    cut = next((p for p in range(window_oldest + 1, n_seen - 511)
                if len({sum(1 for q in h if q < p) for h in held}) > 1), None)
    if cut is not None:
        refused = not llama_cpp.llama_memory_seq_rm(mem, 0, 0, cut)
        result.update(cut=cut, window_oldest=window_oldest, seq_rm_refused=refused,
                      window_oldest_after=llama_cpp.llama_memory_seq_pos_min(mem, 0),
                      counts_after_refusal=per_head.cell_counts(llm).ravel().tolist())
    return result


def scenario_kv_mode_errors(args):
    """What kvp_cpp.Llama says to bad kv_mode requests (run on the stock and on the patched library)."""
    said = {}
    for name, kwargs in (("per_head", {"kv_mode": "per_head"}),
                         ("per_head_compact", {"kv_mode": "per_head", "kv_position_mode": "compact"}),
                         ("bogus", {"kv_mode": "heads"})):
        try:
            kvp_cpp.Llama(kvp_cpp.default_model_path(), n_ctx=256, kv_policy="keydiff", verbose=False, **kwargs)
            said[name] = None
        except (ValueError, RuntimeError) as e:
            said[name] = f"{type(e).__name__}: {e}"
    return said


def scenario_per_head_state(args):
    """kv_mode="per_head": save_state after a prompt ~3x the budget, 12 greedy tokens, load_state, 12 more; the
    same again in a second Llama; each head's positions before the save and after each load; and what a
    shared-mode state says when loaded into a per-head Llama."""
    def make(kv_mode="per_head"):
        return kvp_cpp.Llama(kvp_cpp.default_model_path(), n_ctx=256, kv_policy=args.get("policy", "kvp"),
                             kv_mode=kv_mode, kv_position_mode="original", flash_attn=True, seed=0, verbose=False,
                             n_threads=2, kv_evict_unit=args.get("evict_unit", "token"))

    def greedy(llm, n=12):
        """A fixed first token, then n greedy ones: every step's logits depend on the whole cache."""
        out = []
        token = llm.tokenize(b" The", add_bos=False)[0]
        for _ in range(n):
            llm.eval([token])
            logits = llama_cpp.llama_get_logits(llm._ctx.ctx)  # one output per decode: this token's
            token = int(np.argmax(np.ctypeslib.as_array(logits, shape=(llm.n_vocab(),))))
            out.append(token)
        return out

    def held(positions):
        """Each (layer, head)'s set of positions, whichever cells they are in (a load packs the cells)."""
        L, H = positions.shape[:2]
        return [sorted(positions[l, h][positions[l, h] >= 0].tolist()) for l in range(L) for h in range(H)]

    llm = make()
    llm.eval(llm.tokenize((PROMPT * 12).encode()))
    n_cells = int(llama_cpp.llama_n_ctx(llm._ctx.ctx))
    before = per_head.positions(llm, n_cells)
    state = llm.save_state()
    first = greedy(llm)
    llm.load_state(state)
    after = per_head.positions(llm, n_cells)
    again = greedy(llm)
    other = make()
    other.load_state(state)
    in_other = per_head.positions(other, n_cells)
    from_other = greedy(other)
    shared = make("shared")
    shared.eval(llm.tokenize(PROMPT.encode()))
    try:
        other.load_state(shared.save_state())
        refused = None
    except ValueError as e:
        refused = str(e)
    return {"tokens_evicted": llm.kv_stats()["tokens_evicted"],
            "n_distinct_sets": len({tuple(s) for s in held(before)}),
            "positions_restored": held(before) == held(after),
            "positions_in_other": held(before) == held(in_other),
            "first": first, "again": again, "from_other": from_other, "refused": refused,
            "other_still_works": len(greedy(other, 2)) == 2}


def scenario_graph_scores(args):
    """The same prompt (~715 tokens; 256 cells unless args say otherwise) through the eval-callback scorer and
    through llama.cpp's in-graph scorer: each path's ledger (logical indices and score rows), counters and text."""
    runs = {}
    for scoring in ("callback", "graph"):
        llm = kvp_cpp.Llama(kvp_cpp.default_model_path(), n_ctx=args.get("budget", 256), n_batch=128,
                            kv_policy=args["policy"],
                            kv_mode=args.get("kv_mode", "shared"), kv_position_mode=args.get("position_mode"),
                            kv_compact_limit=args.get("compact_limit", 0), kv_scoring=scoring, flash_attn=True,
                            seed=0, verbose=False, n_threads=2)
        engine = llm._kvp_engine
        out = llm.create_completion(PROMPT * 12, max_tokens=8, temperature=0.0)
        ledger, stats = engine.ledger(), llm.kv_stats()
        runs[scoring] = {"in_graph": engine.scores_in_graph, "callback": engine.callback_address != 0,
                         "logical": ledger["logical"].tolist(), "scores": ledger["scores"].tolist(),
                         "text": out["choices"][0]["text"], "tokens_evicted": stats["tokens_evicted"],
                         "compactions": stats["compactions"]}
        del llm
    return runs


def scenario_scoring_choice(args):
    """Which path kv_scoring picks, and what it says when it cannot (run on the stock and on the patched library)."""
    said = {"gpu": bool(llama_cpp.llama_supports_gpu_offload())}
    for name, kwargs in (("auto_kvp", {"kv_policy": "kvp"}),
                         ("graph_kvp", {"kv_policy": "kvp", "kv_scoring": "graph"}),
                         ("callback_kvp", {"kv_policy": "kvp", "kv_scoring": "callback"}),
                         ("graph_keydiff", {"kv_policy": "keydiff", "kv_scoring": "graph"}),
                         ("bogus", {"kv_policy": "kvp", "kv_scoring": "gpu"})):
        try:
            llm = kvp_cpp.Llama(kvp_cpp.default_model_path(), n_ctx=256, verbose=False, **kwargs)
            said[name] = {"in_graph": llm._kvp_engine.scores_in_graph,
                          "callback": llm._kvp_engine.callback_address != 0}
        except (ValueError, RuntimeError) as e:
            said[name] = f"{type(e).__name__}: {e}"
    return said


def scenario_scorer_api(args):
    """llama_kvp_scorer_* called directly: refused arguments, and scores only for the layers that were set."""
    lib = llama_cpp.llama_cpp._lib
    i32p, f32p = ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_float)
    lib.llama_kvp_scorer_init.argtypes = [ctypes.c_void_p, ctypes.c_int32, i32p, ctypes.c_int32, ctypes.c_int32,
                                          i32p, f32p]
    lib.llama_kvp_scorer_init.restype = ctypes.c_int32
    lib.llama_kvp_scorer_set_layer.argtypes = [ctypes.c_void_p, ctypes.c_int32, f32p, f32p,
                                               ctypes.POINTER(f32p), ctypes.POINTER(f32p)]
    lib.llama_kvp_scorer_set_layer.restype = ctypes.c_int32
    lib.llama_kvp_scorer_scores.argtypes = [ctypes.c_void_p, ctypes.c_int32, i32p]
    lib.llama_kvp_scorer_scores.restype = f32p
    lib.llama_kvp_scorer_free.argtypes = [ctypes.c_void_p]

    llm = make_llama(n_ctx=256)
    ctx = llm._ctx.ctx
    H, D, hidden = 3, 64 + 64 + 1, 4

    def ints(*v):
        return (ctypes.c_int32 * len(v))(*v)

    kinds, a = ints(2), (ctypes.c_float * 1)(0.01)
    result = {
        "set_before_init": lib.llama_kvp_scorer_set_layer(ctx, 0, None, None, None, None),
        "bad_width": lib.llama_kvp_scorer_init(ctx, 2, ints(D + 1, hidden, 1), 0, 1, kinds, a),
        "bad_last": lib.llama_kvp_scorer_init(ctx, 2, ints(D, hidden, 2), 0, 1, kinds, a),
        "bad_activation": lib.llama_kvp_scorer_init(ctx, 2, ints(D, hidden, 1), 9, 1, kinds, a),
        "bad_kind": lib.llama_kvp_scorer_init(ctx, 2, ints(D, hidden, 1), 0, 1, ints(7), a),
        "ok": lib.llama_kvp_scorer_init(ctx, 2, ints(D, hidden, 1), 0, 1, kinds, a),
    }
    rng = np.random.default_rng(0)
    shift = np.zeros((H, D), np.float32)
    scale = np.full((H, D), 0.1, np.float32)
    w = [rng.standard_normal((H, hidden, D)).astype(np.float32), rng.standard_normal((H, 1, hidden)).astype(np.float32)]
    b = [np.zeros((H, hidden), np.float32), np.zeros((H, 1), np.float32)]
    ptr = lambda x: x.ctypes.data_as(f32p)  # noqa: E731
    result["bad_layer"] = lib.llama_kvp_scorer_set_layer(ctx, 30, ptr(shift), ptr(scale), (f32p * 2)(*map(ptr, w)),
                                                         (f32p * 2)(*map(ptr, b)))
    result["set_layer_3"] = lib.llama_kvp_scorer_set_layer(ctx, 3, ptr(shift), ptr(scale), (f32p * 2)(*map(ptr, w)),
                                                           (f32p * 2)(*map(ptr, b)))
    tokens = tokens_of(llm, PROMPT)
    decode(llm, tokens, 0)
    n = ctypes.c_int32(-1)
    got = lib.llama_kvp_scorer_scores(ctx, 3, ctypes.byref(n))
    result["n_scored"] = n.value
    result["layer_3"] = np.ctypeslib.as_array(got, shape=(n.value, H)).tolist() if got else None
    result["layer_4_is_null"] = not bool(lib.llama_kvp_scorer_scores(ctx, 4, ctypes.byref(n))) and n.value == 0
    result["n_tokens"] = len(tokens)
    lib.llama_kvp_scorer_free(ctx)
    decode(llm, llm.tokenize(b" more", add_bos=False), len(tokens))
    result["freed_is_null"] = not bool(lib.llama_kvp_scorer_scores(ctx, 3, ctypes.byref(n)))
    return result


def loaded_libraries():
    """The libllama/libggml files mapped into this process (/proc/self/maps), resolved."""
    import os
    found = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split()
            if len(parts) >= 6 and parts[-1].rsplit("/", 1)[-1].startswith(("libllama", "libggml")):
                found.add(os.path.realpath(parts[-1]))
    return sorted(found)


def scenario_loader(args):
    import os
    result = {"patched": _llama_lib.loaded_library_is_patched(), "lib": str(llama_cpp.llama_cpp._base_path),
              "env": os.environ.get("LLAMA_CPP_LIB_PATH"), "mapped": loaded_libraries()}
    try:
        _llama_lib.require_per_head()
        result["require"] = None
    except RuntimeError as e:
        result["require"] = str(e)
    return result


if __name__ == "__main__":
    name, raw = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "{}")
    result = globals()["scenario_" + name](json.loads(raw))
    sys.stdout.flush()
    print("RESULT " + json.dumps(result))
