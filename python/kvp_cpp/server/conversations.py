"""Conversations under a KV budget: recognising a continuing chat, and one saved state per conversation.

The server runs every request through one ``ConversationLlama``. llama-cpp-python reuses a cache by matching token
prefixes, which assumes that the cache holds the whole prefix; under eviction it holds a policy-chosen subset of the
history instead, and the engine refuses to truncate it (a plain ``kvp_cpp.Llama`` then re-prefills everything). So
continuing conversations are recognised here, on the prompt's tokens, before llama-cpp-python's prefix matching:

- Each conversation remembers its *turn boundary*: the tokens of its last prompt (their count and SHA-256), and the
  tokens of the reply generated after it.
- A new prompt *continues* a conversation when its tokens start with that conversation's last prompt. The longest
  common prefix of the rest with the last reply says how many reply tokens are reused: all of them when the client
  sends the reply back unchanged and it tokenizes the same way, fewer when a stream was cancelled, a stop string
  cut the text, or the client edited or regenerates the reply. Only the remaining tokens are evaluated.
- A prompt that leaves out the end of the last reply's text (the client regenerates or edits it, or another
  client's chat began the same way) *forks* the conversation: a copy of its state continues, and the original stays
  in the store for whoever continues it. The same text in other tokens (the model sampled a split that the tokenizer
  does not produce) continues the conversation itself, and so does any prompt after a reply whose stream was closed
  before it ended (no client saw the rest of it).
- The cache is then cut back to the reused tokens even if the policy evicted tokens before them (the engine's own
  truncation refuses that, since llama-cpp-python expects an exact prefix): the tokens cut are the tail of the last
  reply, and what remains is the policy's compression of exactly the reused history.
- Anything else is a new conversation: its prompt is prefilled under the budget (llama-cpp-python's prefix reuse
  still applies when the cache holds an exact, uncut prefix, such as a shared system prompt).

Only one conversation's state is in the llama.cpp context at a time (the *live* one). Switching to another saves
the live one (its sequence's cells, at most kv_budget of them, and the engine's ledger) into the store and restores
the other, so interleaved conversations do not re-prefill each other. The store is bounded in number and bytes; the
least recently used states go first, and such a conversation is re-prefilled under the budget if it comes back.
"""
from __future__ import annotations

import ctypes
import hashlib
import inspect
import itertools
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

import llama_cpp
import numpy as np
from llama_cpp.llama_tokenizer import LlamaTokenizer

from ..llama import Llama
from .tokens import TokenizationCache, tokenize_with_cache

_COMPLETION_SIGNATURE = inspect.signature(llama_cpp.Llama.create_completion)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


@dataclass
class Snapshot:
    """A conversation's state while it is not live: its sequence's cells and the engine's ledger."""

    seq_state: bytes  # llama_state_seq_get_data of sequence 0: the cached cells, at most kv_budget of them
    engine_state: bytes  # Engine.save(): next logical index + ledger
    n_eval: int  # logical tokens evaluated (the first n_eval of Conversation.tokens)

    @property
    def nbytes(self) -> int:
        return len(self.seq_state) + len(self.engine_state)


@dataclass(eq=False)
class Conversation:
    id: str
    n_prompt: int = 0  # tokens of the last prompt: the turn boundary
    prompt_hash: bytes = b""  # SHA-256 of those tokens (int32)
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.intc))  # last prompt + reply
    snapshot: Optional[Snapshot] = None  # None while live
    turns: int = 0
    cut_short: bool = False  # the last reply's stream was closed before it ended: no client saw all of it

    @property
    def nbytes(self) -> int:
        return (self.snapshot.nbytes if self.snapshot is not None else 0) + self.tokens.nbytes

    def begin_turn(self, prompt: np.ndarray) -> None:
        self.n_prompt, self.prompt_hash, self.tokens = len(prompt), _sha256(prompt.tobytes()), prompt
        self.turns, self.cut_short = self.turns + 1, False

    def match(self, prompt: np.ndarray) -> Optional[int]:
        """How many of this conversation's tokens ``prompt`` repeats, or None if it does not continue it."""
        n = self.n_prompt
        if len(prompt) < n or _sha256(prompt[:n].tobytes()) != self.prompt_hash:
            return None
        rest, reply = prompt[n:], self.tokens[n:]
        length = min(len(rest), len(reply))
        differ = np.flatnonzero(rest[:length] != reply[:length])
        return n + (int(differ[0]) if len(differ) else length)


class ConversationStore:
    """Conversations in least-recently-used order, the saved ones bounded in number and bytes."""

    def __init__(self, max_conversations: int, max_bytes: int):
        if max_conversations < 1:
            raise ValueError("kv_conversations must be at least 1")
        self.max_conversations = int(max_conversations)
        self.max_bytes = int(max_bytes)
        self._items: "OrderedDict[str, Conversation]" = OrderedDict()
        self.live: Optional[Conversation] = None
        self.counters = dict(requests=0, continued=0, forked=0, new=0, untracked=0, switches=0, saved=0, restored=0,
                             dropped=0, cut_back=0, restarted=0, inconsistent=0)  # fmt: skip

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Conversation]:
        return iter(list(self._items.values()))

    def get(self, conversation_id: str) -> Optional[Conversation]:
        return self._items.get(conversation_id)

    def find(self, prompt: np.ndarray) -> Tuple[Optional[Conversation], int]:
        """The conversation that ``prompt`` continues furthest, with the tokens it repeats; (None, 0) if none."""
        best: Optional[Conversation] = None
        best_reused = 0
        for conversation in self._items.values():  # least recently used first
            reused = conversation.match(prompt)
            if reused is None:
                continue
            # Ties go to the live conversation (no switch), then to the most recently used.
            if best is None or reused > best_reused or (reused == best_reused and best is not self.live):
                best, best_reused = conversation, reused
        return best, best_reused

    def add(self, conversation: Conversation) -> None:
        self._items[conversation.id] = conversation
        self.touch(conversation)

    def touch(self, conversation: Conversation) -> None:
        self._items.move_to_end(conversation.id)

    def remove(self, conversation: Conversation) -> None:
        self._items.pop(conversation.id, None)
        if self.live is conversation:
            self.live = None

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self._items.values())

    def enforce_limits(self, keep: Optional[Conversation] = None) -> None:
        """Drops least recently used conversations (never ``keep`` or the live one) until within the bounds."""
        for conversation in list(self._items.values()):
            if len(self._items) <= self.max_conversations and self.nbytes <= self.max_bytes:
                return
            if conversation is keep or conversation is self.live:
                continue
            self.remove(conversation)
            self.counters["dropped"] += 1

    def stats(self) -> Dict[str, Any]:
        return dict(self.counters, conversations=len(self._items), saved_bytes=self.nbytes,
                    max_conversations=self.max_conversations, max_bytes=self.max_bytes,
                    live=self.live.id if self.live is not None else None)  # fmt: skip


@dataclass
class Turn:
    """One request's bookkeeping: which conversation, what was reused, the tokens sampled."""

    conversation: Conversation
    match: str  # "continued", "forked" or "new"
    tokens: List[int]  # the prompt's tokens
    reused: int  # prompt tokens taken from the cache as it was
    tokens_seen: int  # the engine's counter before the request
    sampled: List[int] = field(default_factory=list)
    generators: List[Any] = field(default_factory=list)
    ended: bool = False
    report: Dict[str, Any] = field(default_factory=dict)


class ConversationLlama(Llama):
    """``kvp_cpp.Llama`` that recognises continuing conversations and keeps one saved state per conversation.

    Every ``create_completion`` with a prompt (the tokens chat handlers pass, or a text) is a turn: see the module
    docstring. Not thread-safe: the server calls it from a single worker thread. ``last_turn`` holds the
    report of the latest turn (conversation id, match, tokens reused and evaluated, and the cache's state).
    """

    def __init__(self, model_path: str, *, kv_conversations: int = 16, kv_conversation_memory: int = 1 << 30,
                 **kwargs: Any):
        if kwargs.get("kv_policy") is None:
            raise ValueError("ConversationLlama needs a kv_policy")
        super().__init__(model_path, **kwargs)
        self.conversations = ConversationStore(kv_conversations, kv_conversation_memory)
        self.tokenizations = TokenizationCache(self._model.vocab, kv_conversations)
        self.last_turn: Dict[str, Any] = {}
        self._turn: Optional[Turn] = None

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> List[int]:
        """llama-cpp-python's, but a long prompt that extends a recent one is tokenized only past the last control
        token they share (see tokens.py): chat handlers tokenize the whole conversation on every turn."""
        if not special or len(text) < TokenizationCache.MIN_BYTES or type(self.tokenizer_) is not LlamaTokenizer:
            return super().tokenize(text, add_bos, special)
        return tokenize_with_cache(self.tokenizations, super().tokenize, text, add_bos)

    # --- the turn -----------------------------------------------------------------------------------------------

    def create_completion(self, prompt, suffix=None, max_tokens=16, *args, **kwargs):
        if suffix is not None or not prompt:
            with self._use():
                self._park_live()  # the context now holds no known conversation
                self.conversations.counters["untracked"] += 1
            return super().create_completion(prompt, suffix, max_tokens, *args, **kwargs)
        arguments = _COMPLETION_SIGNATURE.bind(self, prompt, suffix, max_tokens, *args, **kwargs).arguments
        stream = bool(arguments.get("stream", False))
        with self._use():
            if self._turn is not None:  # a previous stream was dropped without being closed
                self._end_turn(self._turn, cut_short=True)
            # Chat handlers pass tokens; a text prompt is tokenized as llama-cpp-python's _create_completion does.
            tokens = self._prompt_tokens(prompt.encode("utf-8")) if isinstance(prompt, str) else [int(t) for t in prompt]
            turn = self._begin_turn(tokens)
        try:
            result = super().create_completion(tokens, None, max_tokens, *args, **kwargs)
        except BaseException:
            self._end_turn(turn)
            raise
        if stream:
            return self._stream(result, turn)
        self._end_turn(turn)
        return result

    def _stream(self, chunks, turn: Turn):
        ended = False
        try:
            yield from chunks
            ended = True
        finally:
            chunks.close()
            self._end_turn(turn, cut_short=not ended)

    def generate(self, tokens, *args, **kwargs):
        grammar = kwargs.get("grammar")
        if grammar is not None:
            self._check_grammar(grammar)
        inner = super().generate(tokens, *args, **kwargs)
        turn = self._turn
        if turn is None:
            return inner
        recorded = self._record(inner, turn)
        turn.generators.append(recorded)
        return recorded

    def _check_grammar(self, grammar: llama_cpp.LlamaGrammar) -> None:
        """llama.cpp returns no sampler for a grammar it cannot parse, and llama-cpp-python adds that null sampler to
        its chain, which crashes the process on the first token: refuse such a grammar first."""
        sampler = llama_cpp.llama_sampler_init_grammar(self._model.vocab, grammar._grammar.encode("utf-8"),
                                                       grammar._root.encode("utf-8"))  # fmt: skip
        if not sampler:
            raise ValueError("the grammar does not parse (llama.cpp's GBNF parser rejected it)")
        llama_cpp.llama_sampler_free(sampler)

    @staticmethod
    def _record(inner, turn: Turn):
        try:
            sent = None
            while True:
                try:
                    token = inner.send(sent)
                except StopIteration:
                    return
                turn.sampled.append(int(token))
                sent = yield token
        finally:
            inner.close()

    def _begin_turn(self, tokens: List[int]) -> Turn:
        store = self.conversations
        store.counters["requests"] += 1
        prompt = np.asarray(tokens, dtype=np.intc)
        conversation, matched = store.find(prompt)
        match = "continued"
        if (conversation is not None and matched < len(conversation.tokens) and not conversation.cut_short
                and not self._same_text(conversation.tokens[matched:], prompt[matched:])):
            # The prompt leaves out the end of a reply that a client received whole: a branch of its own.
            conversation, match = self._fork(conversation), "forked"
        if conversation is None:
            self._park_live()
            conversation = self._new_conversation()
            matched, match = 0, "new"
        else:
            self._make_live(conversation)
        store.counters[match] += 1
        # llama-cpp-python evaluates at least the prompt's last token again (it needs fresh logits).
        reused = min(matched, len(tokens) - 1, self.n_tokens)
        if reused < self.n_tokens and match != "new" and not self._cut_back(reused):
            # Per head, once the heads hold different tokens past `reused`, no cut keeps one consistent prefix:
            # the prompt is evaluated again from its start, within the budget.
            self.kv_engine.reset()
            self.n_tokens = reused = 0
            store.counters["restarted"] += 1
        conversation.begin_turn(prompt)
        store.touch(conversation)
        turn = Turn(conversation, match, tokens, reused, int(self.kv_engine.stats()["tokens_seen"]))
        self._turn = turn
        return turn

    def _same_text(self, reply_tail: np.ndarray, prompt_tail: np.ndarray) -> bool:
        """Whether the prompt goes on with the reply's text in other tokens (the model sampled a split that the
        tokenizer does not produce): then the conversation continues, re-evaluating the reply's tail as tokenized."""
        reply_text = self.detokenize(reply_tail.tolist(), special=True)
        return self.detokenize(prompt_tail[: len(reply_tail) + 8].tolist(), special=True).startswith(reply_text)

    def _new_conversation(self, like: Optional[Conversation] = None) -> Conversation:
        store = self.conversations
        conversation = Conversation(id=uuid.uuid4().hex[:16])
        if like is not None:
            conversation.n_prompt, conversation.prompt_hash = like.n_prompt, like.prompt_hash
            conversation.tokens, conversation.snapshot = like.tokens, like.snapshot  # both are never mutated
        store.add(conversation)
        if like is None:
            store.live = conversation
        store.enforce_limits(keep=conversation)
        return conversation

    def _fork(self, conversation: Conversation) -> Optional[Conversation]:
        """A copy of ``conversation`` (to be made live), leaving the original's saved state as it was: for a client
        that regenerates or edits the last reply, or another client whose chat began the same way."""
        self._park_live()
        if conversation.snapshot is None:  # its state could not be saved
            return None
        return self._new_conversation(like=conversation)

    def _end_turn(self, turn: Turn, cut_short: bool = False) -> None:
        """Records the reply on the conversation, and checks that the context still matches it."""
        if turn.ended:
            return
        turn.ended = True
        if self._turn is turn:
            self._turn = None
        for generator in turn.generators:
            generator.close()  # releases the thread guard of a generate() left suspended
        turn.generators.clear()
        store, conversation = self.conversations, turn.conversation
        reply = list(itertools.takewhile(lambda t: not llama_cpp.llama_vocab_is_eog(self._model.vocab, t),
                                         turn.sampled))  # fmt: skip
        tokens = np.asarray(turn.tokens + reply, dtype=np.intc)
        n = self.n_tokens
        consistent = (store.live is conversation and n <= len(tokens)
                      and self.kv_engine.logical_length == n and np.array_equal(self.input_ids[:n], tokens[:n]))
        if not consistent:  # an error left the context elsewhere: forget the conversation, keep the server going
            store.counters["inconsistent"] += 1
            store.remove(conversation)
        else:
            conversation.tokens, conversation.cut_short = tokens, cut_short
        stats = self.kv_stats()
        turn.report = {
            "conversation": conversation.id if consistent else None, "match": turn.match,
            "prompt_tokens": len(turn.tokens), "reused_tokens": turn.reused, "generated_tokens": len(reply),
            "evaluated_tokens": int(stats["tokens_seen"]) - turn.tokens_seen, "cells_used": int(stats["cells_used"]),
            "budget": int(stats["budget"]), "logical_tokens": int(stats["logical_tokens"]),
            "tokens_evicted": int(stats["tokens_evicted"]), "policy": stats["policy"],
        }  # fmt: skip
        self.last_turn = turn.report

    def _prompt_tokens(self, prompt: bytes) -> List[int]:
        """The tokens llama-cpp-python's _create_completion makes of a text prompt (BOS if the model adds one)."""
        cls_token, bos_token = self._model.token_cls(), self.token_bos()
        first = cls_token if cls_token != -1 else bos_token
        bos = [first] if self._model.add_bos_token() and first != -1 else []
        return bos + self.tokenize(prompt, add_bos=False, special=True)

    # --- which conversation the context holds -------------------------------------------------------------------

    def _park_live(self) -> None:
        """Saves the live conversation's state into the store; the context is then free for another."""
        store = self.conversations
        live = store.live
        if live is None:
            return
        store.live = None
        n = self.n_tokens
        if not (self.kv_engine.logical_length == n and n <= len(live.tokens)):
            store.counters["inconsistent"] += 1
            store.remove(live)
            return
        live.snapshot = Snapshot(self._seq_state(), bytes(self.kv_engine.save()), n)
        store.counters["saved"] += 1
        store.enforce_limits()

    def _make_live(self, conversation: Conversation) -> None:
        store = self.conversations
        if store.live is conversation:
            return
        self._park_live()
        store.counters["switches"] += 1
        snapshot, conversation.snapshot = conversation.snapshot, None
        store.live = conversation
        engine = self.kv_engine
        engine.reset()  # clears the sequence's cells and the ledger
        self.n_tokens = 0
        try:
            data = (ctypes.c_uint8 * len(snapshot.seq_state)).from_buffer_copy(snapshot.seq_state)
            if llama_cpp.llama_state_seq_set_data(self._ctx.ctx, data, len(snapshot.seq_state), 0) == 0:
                raise RuntimeError("llama.cpp could not restore a saved conversation's cells")
            engine.restore(snapshot.engine_state)
        except BaseException:
            engine.reset()
            store.counters["inconsistent"] += 1
            store.remove(conversation)
            raise
        self._reserve_logical(snapshot.n_eval)
        self.input_ids[: snapshot.n_eval] = conversation.tokens[: snapshot.n_eval]
        self.n_tokens = snapshot.n_eval
        self._requires_eval = True  # the context's logits belong to whatever ran before
        store.counters["restored"] += 1

    def _seq_state(self) -> bytes:
        ctx = self._ctx.ctx
        size = llama_cpp.llama_state_seq_get_size(ctx, 0)
        buffer = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(ctx, buffer, size, 0)
        return ctypes.string_at(buffer, written)  # slicing a c_uint8 array would build a list of ints

    def _cut_back(self, n: int) -> bool:
        """Forgets the logical tokens from ``n`` on, keeping the cache's policy-chosen subset of the ones before
        (``Engine.forget_from``; ``Engine.truncate`` would refuse once a token before ``n`` was evicted). False,
        with nothing changed, where per-head eviction left the heads holding different tokens from ``n`` on."""
        forgets = n < self.kv_engine.logical_length
        if not self.kv_engine.forget_from(n):
            return False
        self.conversations.counters["cut_back"] += forgets
        self.n_tokens = n
        return True

    # --- introspection ------------------------------------------------------------------------------------------

    def cached_tokens(self) -> Dict[str, Any]:
        """Which tokens of the live conversation the cache holds: their logical indices and token ids (per head: the
        tokens that at least one head holds, so more than ``cells_used``, which counts one head's cells)."""
        with self._use():
            logical = self.kv_engine.ledger()["logical"]
            live = self.conversations.live
            return {"conversation": live.id if live is not None else None, "logical_tokens": self.n_tokens,
                    "logical": logical.tolist(), "tokens": self.input_ids[logical].tolist()}  # fmt: skip

    def server_stats(self) -> Dict[str, Any]:
        """The cache, the conversation store, the latest finished turn and whether one is under way (/kv/stats)."""
        with self._use():
            stats = self.kv_stats()
            stats["consistent"] = bool(self.kv_engine.logical_length == self.n_tokens)
        tokenized = {"reused_tokens": self.tokenizations.reused_tokens, "bytes": self.tokenizations.tokenized_bytes,
                     "cache_bytes": self.tokenizations.nbytes}  # fmt: skip
        return {"kv": stats, "conversations": self.conversations.stats(), "tokenization": tokenized,
                "last_turn": dict(self.last_turn), "in_turn": self._turn is not None}  # fmt: skip
