"""``kvp_cpp.Llama``: llama-cpp-python's ``Llama`` with a KV cache held to a fixed budget by an eviction policy.

With ``kv_policy=None`` the class is exactly ``llama_cpp.Llama``. With a policy, the cache never holds more than
``kv_budget`` cells of the sequence, whatever the prompt or conversation length; the policy decides which tokens
leave. ``n_tokens``/``input_ids`` keep the whole *logical* history (every token ever evaluated), while the engine's
ledger maps the tokens still cached to their cache positions.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from typing import Any, Dict, Optional, Sequence

import numpy as np
import llama_cpp
from llama_cpp import _internals as internals

from . import _core, _llama_lib
from .shipped import SHIPPED_VARIANTS, resolve_shipped_name

#: Logical tokens (everything ever evaluated in the sequence) a policy-driven Llama accepts by default. Only
#: ``input_ids`` (4 bytes per token) grows with it; the KV cache stays at the budget.
DEFAULT_MAX_TOKENS = 1 << 20

#: llama.cpp allocates KV cells in multiples of this (a budget of 300 gets a 512-cell context).
KV_CELL_ROUNDING = 256

POSITION_MODES = ("compact", "original")
#: shared: one token set for all heads (stock llama.cpp); per_head: each (layer, KV head) keeps its own (the
#: patched llama.cpp, KVP_CPP_LLAMA=per_head; see docs/per_head.md)
KV_MODES = ("shared", "per_head")
#: where a learned policy's MLP runs: auto (graph with the patched llama.cpp and a GPU), callback, graph
SCORING_PATHS = ("auto", "callback", "graph")
EVICTION_UNITS = ("token", "word")
HEAD_COMBINES = ("sum_softmax", "max_softmax", "mean", "mean_rank")


def _address(pointer) -> int:
    """The integer address behind a ctypes pointer (what the native engine takes)."""
    address = ctypes.cast(pointer, ctypes.c_void_p).value
    if not address:
        raise RuntimeError("null llama.cpp handle (was this Llama closed?)")
    return address


def _physical_memory_bytes() -> int:
    """The machine's physical memory, the ceiling for a KV cache (see ``Llama``'s ``kv_budget``)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def model_identity(model_path: str) -> Dict[str, Any]:
    """What a policy must match in a GGUF model: arch, n_layer, n_head_kv, head dims, n_ctx_train."""
    # A vocab-only model has no hyperparameters to ask; loading the weights is an mmap and no context is created.
    model = internals.LlamaModel(path_model=model_path, params=llama_cpp.llama_model_default_params(), verbose=False)
    try:
        return dict(_core.model_identity(_address(model.model)))
    finally:
        model.close()


def builtin_policies() -> list:
    """Names accepted by ``kv_policy`` besides a path to a ``.kvp.bin`` file."""
    return list(_core.builtin_policies())


def recreate_context(llm: llama_cpp.Llama, *, callback_address: int = 0, user_data: int = 0,
                     n_ctx: Optional[int] = None, context_factory=internals.LlamaContext) -> None:
    """Re-creates ``llm``'s llama_context with a native eval callback installed (and optionally another n_ctx).

    llama.h has no setter for the eval callback: it must be in the params before the context exists, and
    ``llama_cpp.Llama.__init__`` creates its context inline. The object behind ``user_data`` must outlive the
    context. A LoRA adapter set on the old context is set again on the new one.
    """
    llm._ctx.close()
    params = llm.context_params
    if n_ctx is not None:
        params.n_ctx = n_ctx
    if callback_address:
        params.cb_eval = llama_cpp.ggml_backend_sched_eval_callback(callback_address)
        params.cb_eval_user_data = ctypes.c_void_p(user_data)
    llm._ctx = llm._stack.enter_context(
        contextlib.closing(context_factory(model=llm._model, params=params, verbose=llm.verbose))
    )
    if llm._lora_adapter is not None:
        adapters = (llama_cpp.llama_adapter_lora_p_ctypes * 1)(llm._lora_adapter)
        scales = (ctypes.c_float * 1)(llm.lora_scale)
        if llama_cpp.llama_set_adapters_lora(llm._ctx.ctx, adapters, 1, scales):
            raise RuntimeError(f"Failed to set LoRA adapter from lora path: {llm.lora_path}")
    llm.reset()


class KvpLlamaState(llama_cpp.LlamaState):
    """``LlamaState`` plus the eviction engine's ledger, so a restored state knows which tokens are cached where."""

    def __init__(self, *args, kv_engine_state: bytes, **kwargs):
        super().__init__(*args, **kwargs)
        self.kv_engine_state = kv_engine_state


class _EvictingContext(internals.LlamaContext):
    """The context of a policy-driven Llama.

    ``llama_cpp.Llama`` removes "every token from logical index p0 on" with ``kv_cache_seq_rm(-1, p0, -1)``, using
    the logical index as a cache position. Here that request goes to the engine, which knows where each cached token
    lives, and refuses (returns False) when part of the kept prefix was already evicted: ``generate()`` then resets
    and re-prefills under the budget instead of reusing a cache that no longer holds the prefix.
    """

    def __init__(self, engine: "_core.Engine", **kwargs):
        super().__init__(**kwargs)
        self.kvp_engine = engine

    def kv_cache_seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        if seq_id not in (-1, 0) or p1 >= 0:
            raise ValueError("a policy-driven context only supports removing a suffix of sequence 0")
        return self.kvp_engine.truncate(max(p0, 0))

    def kv_cache_clear(self):
        self.kvp_engine.reset()


class Llama(llama_cpp.Llama):
    """A drop-in ``llama_cpp.Llama`` whose KV cache is bounded by an eviction policy.

    Extra arguments (all keyword-only):

    - ``kv_policy``: ``None`` (plain llama.cpp), ``"kvp"`` (the shipped learned policy for this model), a built-in
      heuristic (see ``builtin_policies()``) or a path to a ``.kvp.bin`` file trained for this model.
    - ``kv_budget``: cells the sequence may hold, in tokens; defaults to ``n_ctx``. The context is allocated for
      exactly this budget (llama.cpp rounds it up to a multiple of 256). A budget whose KV cache, at that rounded
      size and the context's ``type_k``/``type_v``, needs more bytes than the machine's physical memory
      (``SC_PHYS_PAGES * SC_PAGE_SIZE``) is refused with a ValueError naming both, before that cache is
      allocated. (With ``kv_budget=None`` the budget is ``n_ctx``, which ``llama_cpp.Llama`` allocates first.)
    - ``kv_sink`` / ``kv_recent``: the first and the last tokens that are never evicted (defaults: the policy
      file's, else 4 and 16). ``kv_recent`` >= 1, since a batch must follow the newest cached position. On models
      with sliding-window layers (Gemma 3) it is raised to the window, whose tokens must stay for those layers.
    - ``kv_mode``: ``"shared"`` (default; one token set for all heads, any llama.cpp) or ``"per_head"`` (each
      (layer, KV head) keeps and evicts its own tokens; needs the patched llama.cpp, ``KVP_CPP_LLAMA=per_head`` and
      ``python -m kvp_cpp.llama_build``, and original positions; see docs/per_head.md). On models with
      sliding-window layers the other layers are per head, and the window's own cache is llama.cpp's.
      ``kv_head_combine`` does not apply to it.
    - ``kv_head_consensus``: per-head mode only, a weight in [0, 1] (default ``None``: 0.9,
      ``_core.DEFAULT_HEAD_CONSENSUS``, in per-head mode): each head ranks its tokens by ``(1 - w)`` x its own
      softmax + ``w`` x the mean of all heads' softmax, so that tokens many heads want stay in every head; 0 is the
      paper's independent per-head eviction, 1 evicts what shared mode would (docs/per_head.md).
    - ``kv_position_mode``: ``"compact"`` (default; ``"original"`` with ``kv_mode="per_head"``) shifts positions down over evicted gaps, lazily, only when the
      next position would reach the model's training context; ``"original"`` keeps every token's position.
    - ``kv_evict_fraction``: a full cache sheds at least this fraction of the budget at once (default 1/16).
    - ``kv_head_combine``: how per-head scores become one keep-score per token (cells are shared by all heads):
      ``"sum_softmax"`` (default), ``"max_softmax"``, ``"mean"``, ``"mean_rank"``.
    - ``kv_compact_limit``: in compact mode, positions stay below this (default 0: the model's n_ctx_train).
    - ``kv_seed``: seed of the ``random`` policy, an integer in [0, 2**64). ``kv_max_tokens``: the logical length
      limit (default 2**20).
    - ``kv_kernel`` / ``kv_threads``: scorer kernel (``"auto"`` or a name from ``available_kernels()``) and threads.
    - ``kv_scoring``: where a learned policy's MLP runs: ``"auto"`` (default: inside llama.cpp's decode graph when
      the patched llama.cpp is loaded and has a GPU backend, else on the CPU through the eval callback, which is
      the faster of the two on a CPU), ``"callback"`` or ``"graph"`` (the patched llama.cpp; see
      docs/graph_scoring.md). Both give the same scores.
    - ``kv_evict_unit``: ``"word"`` (default) ranks the sub-word tokens of a word (no space or punctuation between
      them, at most 16 tokens) by the word's best score, so a word stays or leaves whole instead of leaving
      fragments the model misreads; ``"token"`` ranks every token by its own score, as the paper and the
      baselines' original papers do (docs/policies.md, "Word-level eviction").
    """

    def __init__(
        self,
        model_path: str,
        *,
        kv_policy: Optional[str] = None,
        kv_budget: Optional[int] = None,
        kv_sink: Optional[int] = None,
        kv_recent: Optional[int] = None,
        kv_mode: str = "shared",
        kv_position_mode: Optional[str] = None,
        kv_evict_fraction: float = 0.0625,
        kv_head_combine: str = "sum_softmax",
        kv_head_consensus: Optional[float] = None,
        kv_seed: int = 0,
        kv_compact_limit: int = 0,
        kv_max_tokens: int = DEFAULT_MAX_TOKENS,
        kv_kernel: str = "auto",
        kv_threads: int = 0,
        kv_scoring: str = "auto",
        kv_evict_unit: Optional[str] = None,
        **kwargs: Any,
    ):
        self._kvp_engine: Optional[_core.Engine] = None
        self._kvp_owner: Optional[int] = None  # the thread using this instance (see _use)
        self._kvp_depth = 0
        self._kvp_guard = threading.Lock()
        if kv_position_mode is None:
            kv_position_mode = "original" if kv_mode == "per_head" else "compact"
        if kv_evict_unit is None:  # whole words where there is eviction; a full cache has no unit
            kv_evict_unit = "word" if kv_policy is not None else "token"
        self._kvp_args = dict(
            kv_policy=kv_policy, kv_mode=kv_mode, kv_budget=kv_budget, kv_sink=kv_sink, kv_recent=kv_recent,
            kv_position_mode=kv_position_mode, kv_evict_fraction=kv_evict_fraction, kv_head_combine=kv_head_combine,
            kv_head_consensus=kv_head_consensus, kv_seed=kv_seed, kv_compact_limit=kv_compact_limit,
            kv_max_tokens=kv_max_tokens, kv_kernel=kv_kernel, kv_threads=kv_threads, kv_scoring=kv_scoring,
            kv_evict_unit=kv_evict_unit,
        )
        if kv_policy is None:
            if kv_mode != "shared":
                raise ValueError(f"kv_mode={kv_mode!r} needs a kv_policy")
            if kv_evict_unit != "token":
                raise ValueError(f"kv_evict_unit={kv_evict_unit!r} needs a kv_policy")
            super().__init__(model_path, **kwargs)
            return

        self._check_kv_arguments(kwargs)
        super().__init__(model_path, **kwargs)
        self._requested_n_ctx = self.context_params.n_ctx  # before the context is resized to the budget

        budget = kv_budget if kv_budget is not None else self.context_params.n_ctx
        policy = self._kvp_args["kv_policy"]
        if policy in SHIPPED_VARIANTS:
            policy = resolve_shipped_name(policy, _core.model_identity(_address(self._model.model)))
        engine = _core.Engine(
            _address(self._model.model), policy, int(budget),
            n_sink=-1 if kv_sink is None else int(kv_sink), n_recent=-1 if kv_recent is None else int(kv_recent),
            position_mode=kv_position_mode, evict_fraction=float(kv_evict_fraction), combine=kv_head_combine,
            compact_limit=int(kv_compact_limit), seed=int(kv_seed), kernel=kv_kernel, n_threads=int(kv_threads),
            per_head=kv_mode == "per_head", scoring=kv_scoring,
            head_consensus=None if kv_head_consensus is None else float(kv_head_consensus),
            eviction_unit=kv_evict_unit,
        )
        self._check_kv_cache_fits(int(budget))
        self._recreate_context(engine, int(budget))
        self._kvp_engine = engine
        self._n_ctx = int(kv_max_tokens)

    # --- construction -------------------------------------------------------------------------------------------

    def _check_kv_arguments(self, kwargs: Dict[str, Any]) -> None:
        """Rejects bad kv_* arguments before the model is loaded. The engine checks the rest (the budget against
        the policy's protected counts, the policy file against the model) and raises ValueError too."""
        args = self._kvp_args
        policy = args["kv_policy"]
        if not isinstance(policy, (str, os.PathLike)):
            raise ValueError(f"kv_policy must be a policy name or a path, not {type(policy).__name__}")
        policy = os.fspath(policy)
        if isinstance(policy, bytes):
            policy = os.fsdecode(policy)
        try:
            policy.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"kv_policy path {policy!r} is not valid UTF-8; rename the policy file") from None
        self._kvp_args["kv_policy"] = policy
        known = builtin_policies() + list(SHIPPED_VARIANTS)
        if policy not in known:
            if os.path.sep not in policy and "." not in policy:
                raise ValueError(f"unknown kv_policy '{policy}': use one of {', '.join(known)}, or a .kvp.bin path")
            if not os.path.isfile(policy):
                raise ValueError(f"kv_policy file not found: {policy}")

        budget = args["kv_budget"] if args["kv_budget"] is not None else kwargs.get("n_ctx", 512)
        checked = {"kv_budget": budget, "kv_sink": args["kv_sink"], "kv_recent": args["kv_recent"]}
        for name, value in checked.items():
            if value is not None and (not isinstance(value, (int, np.integer)) or isinstance(value, bool)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        sink = 0 if args["kv_sink"] is None else args["kv_sink"]
        recent = 1 if args["kv_recent"] is None else args["kv_recent"]
        if recent < 1:
            raise ValueError("kv_recent must be >= 1: the newest token can never be evicted")
        if sink < 0:
            raise ValueError("kv_sink must be >= 0")
        if budget < 0 or (budget != 0 and budget < sink + recent + 1):
            raise ValueError(f"kv_budget {budget} must be at least kv_sink + kv_recent + 1 = {sink + recent + 1}")
        if budget > (1 << 24):
            raise ValueError(f"kv_budget {budget} is larger than any KV cache this engine supports (2**24)")
        if args["kv_mode"] not in KV_MODES:
            raise ValueError(f"kv_mode must be one of {KV_MODES}, got {args['kv_mode']!r}")
        if args["kv_mode"] == "per_head":
            if args["kv_position_mode"] != "original":
                raise ValueError("kv_mode='per_head' keeps original positions: kv_position_mode must be 'original'")
            _llama_lib.require_per_head()  # RuntimeError naming what to do when the patched llama.cpp is not loaded
        if args["kv_scoring"] not in SCORING_PATHS:
            raise ValueError(f"kv_scoring must be one of {SCORING_PATHS}, got {args['kv_scoring']!r}")
        if args["kv_scoring"] == "graph":
            _llama_lib.require_graph_scoring()
        if args["kv_evict_unit"] not in EVICTION_UNITS:
            raise ValueError(f"kv_evict_unit must be one of {EVICTION_UNITS}, got {args['kv_evict_unit']!r}")
        if args["kv_position_mode"] not in POSITION_MODES:
            raise ValueError(f"kv_position_mode must be one of {POSITION_MODES}, got {args['kv_position_mode']!r}")
        if args["kv_head_combine"] not in HEAD_COMBINES:
            raise ValueError(f"kv_head_combine must be one of {HEAD_COMBINES}, got {args['kv_head_combine']!r}")
        if not 0.0 <= float(args["kv_evict_fraction"]) <= 1.0:
            raise ValueError("kv_evict_fraction must be in [0, 1]")
        consensus = args["kv_head_consensus"]  # None: the engine's default for the mode
        if consensus is not None:
            if isinstance(consensus, bool) or not isinstance(consensus, (int, float, np.integer, np.floating)) \
                    or not 0.0 <= float(consensus) <= 1.0:
                raise ValueError(f"kv_head_consensus must be a number in [0, 1], got {consensus!r}")
            if consensus != 0 and args["kv_mode"] != "per_head":
                raise ValueError("kv_head_consensus applies to kv_mode='per_head' only (shared mode ranks by all "
                                 "heads' vote already)")
        seed = args["kv_seed"]
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < (1 << 64):
            raise ValueError(f"kv_seed must be an integer in [0, 2**64), got {seed!r}")
        if args["kv_max_tokens"] < 1:
            raise ValueError("kv_max_tokens must be positive")
        if kwargs.get("draft_model") is not None:
            raise ValueError("draft_model (speculative decoding) is not supported together with kv_policy")
        if kwargs.get("vocab_only"):
            raise ValueError("kv_policy needs the model's weights; it cannot be combined with vocab_only=True")
        if kwargs.get("embedding"):
            raise ValueError("kv_policy applies to generation; it cannot be combined with embedding=True")

    def _check_kv_cache_fits(self, budget: int) -> None:
        """Refuses a budget whose KV cache would not fit in the machine's physical memory, before llama.cpp
        allocates (and zero-fills) it: with overcommit the allocation itself succeeds and the process is killed."""
        cells = -(-budget // KV_CELL_ROUNDING) * KV_CELL_ROUNDING
        needed = int(_core.kv_cache_bytes(_address(self._model.model), cells, self.context_params.type_k,
                                          self.context_params.type_v))
        available = _physical_memory_bytes()
        if needed > available:
            raise ValueError(
                f"kv_budget {budget} needs a KV cache of {needed} bytes ({cells} cells, {needed / 2**30:.1f} GiB), "
                f"more than the {available} bytes ({available / 2**30:.1f} GiB) of physical memory on this machine"
            )

    def _recreate_context(self, engine: "_core.Engine", budget: int) -> None:
        recreate_context(self, callback_address=engine.callback_address, user_data=engine.address, n_ctx=budget,
                         context_factory=lambda **kwargs: _EvictingContext(engine, **kwargs))
        # The context holds a raw pointer to the engine: detach before the context is freed (ExitStack is LIFO).
        self._stack.callback(engine.detach)
        engine.attach(_address(self._ctx.ctx))

    # --- the decode path ----------------------------------------------------------------------------------------

    # --- one thread at a time ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _use(self):
        """Marks this instance as used by the calling thread for the duration of a call (re-entrant).

        Neither llama.cpp's context nor the engine may be driven from two threads at once, and a generation from
        one thread interleaved with calls from another would silently mix their caches. A second thread is refused
        with a RuntimeError while the first one is inside a call or holds an unfinished ``generate()``.
        """
        if self._kvp_engine is None:
            yield
            return
        if self._ctx is None or self._ctx.ctx is None:
            raise RuntimeError("this Llama is closed")
        me = threading.get_ident()
        with self._kvp_guard:
            if self._kvp_owner not in (None, me):
                raise RuntimeError("this Llama is in use by another thread; a kv_policy Llama serves one thread at "
                                   "a time (use one instance per thread, or serialise the calls)")
            self._kvp_owner = me
            self._kvp_depth += 1
        try:
            yield
        finally:
            with self._kvp_guard:
                self._kvp_depth -= 1
                if self._kvp_depth == 0:
                    self._kvp_owner = None

    def generate(self, tokens, *args, **kwargs):
        if self._kvp_engine is None:
            yield from super().generate(tokens, *args, **kwargs)
            return
        with self._use():
            yield from super().generate(tokens, *args, **kwargs)

    # --- the decode path ----------------------------------------------------------------------------------------

    def eval(self, tokens: Sequence[int]):
        engine = self._kvp_engine
        if engine is None:
            return super().eval(tokens)
        with self._use():
            self._eval_under_budget(engine, list(tokens))

    def _eval_under_budget(self, engine: "_core.Engine", tokens: list) -> None:
        if not engine.truncate(self.n_tokens):
            # Part of the kept prefix was evicted: replay the logical history under the budget.
            tokens = self.input_ids[: self.n_tokens].tolist() + tokens
            engine.reset()
            self.n_tokens = 0
        self._reserve_logical(self.n_tokens + len(tokens))
        start = 0
        while start < len(tokens):
            batch = tokens[start : start + engine.next_batch_size(len(tokens) - start, self.n_batch)]
            start += len(batch)
            n_past, n = self.n_tokens, len(batch)
            first_position = engine.begin_batch(n, batch)  # token ids: word-level eviction groups them into words
            try:
                self._batch.set_batch(batch=batch, n_past=first_position, logits_all=self._logits_all)
                self._ctx.decode(self._batch)
            except BaseException:
                engine.abort_batch()
                raise
            engine.end_batch()
            self.input_ids[n_past : n_past + n] = batch
            if self._logits_all:
                logits = np.ctypeslib.as_array(self._ctx.get_logits(), shape=(n * self._n_vocab,))
                self.scores[n_past : n_past + n, :].reshape(-1)[::] = logits
            self.n_tokens += n
            self._requires_eval = False

    def _reserve_logical(self, length: int) -> None:
        if length > self._n_ctx:
            raise ValueError(
                f"Requested tokens ({length}) exceed the logical limit kv_max_tokens={self._n_ctx} of this Llama"
            )
        if self._logits_all and length > self.scores.shape[0]:
            raise ValueError(
                f"logits_all keeps one logits row per token and is limited to n_ctx={self.scores.shape[0]} tokens; "
                f"requested {length}"
            )
        if length > self.input_ids.shape[0]:
            grown = np.zeros(max(length, 2 * self.input_ids.shape[0]), dtype=np.intc)
            grown[: self.n_tokens] = self.input_ids[: self.n_tokens]
            self.input_ids = grown

    def reset(self):
        if self._kvp_engine is None:
            return super().reset()
        with self._use():
            super().reset()
            self._kvp_engine.reset()

    # --- state --------------------------------------------------------------------------------------------------

    def save_state(self) -> llama_cpp.LlamaState:
        if self._kvp_engine is None:
            return super().save_state()
        with self._use():
            state = super().save_state()
        return KvpLlamaState(
            input_ids=state.input_ids, scores=state.scores, n_tokens=state.n_tokens, llama_state=state.llama_state,
            llama_state_size=state.llama_state_size, seed=state.seed, kv_engine_state=self._kvp_engine.save(),
        )

    def load_state(self, state: llama_cpp.LlamaState) -> None:
        """Restores a state from ``save_state()``. With a kv_policy, all or nothing: a state that is refused (a
        corrupt or foreign ledger image, sizes that do not match, or llama.cpp refusing its part) raises and leaves
        this Llama as it was, cache, ledger, ``input_ids`` and ``n_tokens`` included. To undo a refusal by
        llama.cpp, which may already have overwritten the cache, the current llama.cpp state is copied first (the KV
        cache at the budget and the last logits: as much memory again as a saved state, for the call's duration)."""
        if self._kvp_engine is not None and not isinstance(state, KvpLlamaState):
            raise ValueError("this state was saved without a kv_policy; it cannot be loaded into a policy-driven Llama")
        if self._kvp_engine is None:
            return super().load_state(state)
        with self._use():
            self._load_state_or_nothing(self._kvp_engine, state)

    def _load_state_or_nothing(self, engine: "_core.Engine", state: KvpLlamaState) -> None:
        # Everything checkable is checked before anything changes (llama_cpp.Llama.load_state sets input_ids and
        # n_tokens first and fails afterwards).
        engine.check_image(state.kv_engine_state)
        size = int(state.llama_state_size)
        if size != len(state.llama_state):
            raise ValueError(f"llama_state_size is {size} but llama_state holds {len(state.llama_state)} bytes")
        n_tokens = int(state.n_tokens)
        if not 0 <= n_tokens <= len(state.input_ids):
            raise ValueError(f"n_tokens {n_tokens} is outside 0..{len(state.input_ids)} (the saved input_ids)")
        try:
            np.broadcast_to(state.scores, self.scores[:n_tokens, :].shape)
        except ValueError:
            raise ValueError(f"the saved scores {np.shape(state.scores)} do not fit this Llama's "
                             f"{self.scores[:n_tokens, :].shape}") from None

        ctx = self._ctx.ctx
        previous = (ctypes.c_uint8 * int(llama_cpp.llama_state_get_size(ctx)))()
        previous_size = llama_cpp.llama_state_get_data(ctx, previous, len(previous))
        # per-head mode: which position each head holds where (a llama.cpp state does not keep it)
        previous_engine = engine.save() if self._kvp_args["kv_mode"] == "per_head" else None
        loaded = (ctypes.c_uint8 * size).from_buffer_copy(state.llama_state)
        try:
            if llama_cpp.llama_state_set_data(ctx, loaded, size) != size:
                raise RuntimeError("Failed to set llama state data (llama.cpp refused the saved state)")
            engine.restore(state.kv_engine_state)  # checked above: only a logic error can fail here
        except BaseException:
            if llama_cpp.llama_state_set_data(ctx, previous, previous_size) != previous_size:
                # Not expected (llama.cpp wrote that image itself a moment ago): at least keep the cache, the ledger
                # and the logical history consistent, empty.
                engine.reset()
                self.n_tokens = 0
            elif previous_engine is not None:
                engine.restore(previous_engine)
            raise

        # As llama_cpp.Llama.load_state, now that nothing can fail.
        self.scores[:n_tokens, :] = state.scores
        rest = self.scores[n_tokens:, :]
        rest[rest > 0] = 0.0
        self.input_ids = state.input_ids.copy()
        self.n_tokens = n_tokens
        self._requires_eval = True
        self._seed = state.seed

    def __getstate__(self):
        state = super().__getstate__()
        state.update(self._kvp_args)
        if self._kvp_engine is not None:
            state["n_ctx"] = self._requested_n_ctx  # context_params.n_ctx now holds the budget
        return state

    def create_completion(self, prompt, suffix=None, max_tokens=16, *args, **kwargs):
        # llama-cpp-python reads max_tokens None or <= 0 as "until the context is full". Under a policy the cache
        # never fills, so that would mean up to kv_max_tokens; it means up to kv_budget new tokens instead.
        if self._kvp_engine is None:
            return super().create_completion(prompt, suffix, max_tokens, *args, **kwargs)
        with self._use():  # refuses a closed instance before llama.cpp sees a freed context
            if max_tokens is None or max_tokens <= 0:
                max_tokens = self._kvp_engine.stats()["budget"]
        return super().create_completion(prompt, suffix, max_tokens, *args, **kwargs)

    def close(self) -> None:
        # __init__ may fail (bad kv_* arguments) before llama_cpp.Llama has built its exit stack.
        if getattr(self, "_stack", None) is not None:
            super().close()

    # --- introspection ------------------------------------------------------------------------------------------

    @property
    def kv_engine(self) -> Optional["_core.Engine"]:
        return self._kvp_engine

    def kv_compress(self, budget: int) -> int:
        """The oneshot protocol: evict down to ``budget`` cells now, the policy ranking every cached token, and keep
        that budget from then on. Create the Llama with a budget large enough for the whole context first, evaluate
        it (with or without the question), then compress. Returns the number of tokens evicted."""
        if self._kvp_engine is None:
            raise ValueError("kv_compress() needs a kv_policy")
        if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)):
            raise ValueError(f"kv_compress() needs an integer budget, got {budget!r}")
        if not -(1 << 62) < budget < (1 << 62):  # the engine checks the rest, in int64
            raise ValueError(f"cannot compress to {budget} cells: far beyond any context")
        with self._use():
            return self._kvp_engine.compress(int(budget))

    def kv_set_budget(self, budget: int) -> None:
        """Changes the budget from now on without evicting; it must hold the cells in use. After ``kv_compress``
        the paper's and kvpress's oneshot protocol appends the question and the answer to the compressed cache
        without further eviction: raise the budget by their length (up to the context's cells) to do the same."""
        if self._kvp_engine is None:
            raise ValueError("kv_set_budget() needs a kv_policy")
        if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)):
            raise ValueError(f"kv_set_budget() needs an integer budget, got {budget!r}")
        if not -(1 << 62) < budget < (1 << 62):
            raise ValueError(f"cannot set the budget to {budget} cells: far beyond any context")
        with self._use():
            self._kvp_engine.set_budget(int(budget))

    def kv_stats(self) -> Dict[str, Any]:
        """Cells in use, budget, KV bytes allocated, tokens seen and evicted, and where the engine's time went."""
        if self._kvp_engine is None:
            raise ValueError("kv_stats() needs a kv_policy")
        if self._ctx is None or self._ctx.ctx is None:
            raise RuntimeError("this Llama is closed")
        stats = dict(self._kvp_engine.stats())
        stats["policy"] = self._kvp_engine.policy_name
        stats["kv_mode"] = self._kvp_args["kv_mode"]
        stats["n_ctx_cells"] = int(llama_cpp.llama_n_ctx(self._ctx.ctx))
        stats["kv_bytes_allocated"] = int(
            _core.kv_cache_bytes(_address(self._model.model), stats["n_ctx_cells"], self.context_params.type_k,
                                 self.context_params.type_v)
        )
        stats["logical_tokens"] = self.n_tokens
        return stats
