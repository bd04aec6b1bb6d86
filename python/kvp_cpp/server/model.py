"""The model loader: llama-cpp-python's ``LlamaProxy`` building a ``ConversationLlama`` instead of a ``llama_cpp.Llama``.

llama-cpp-python's loader (``LlamaProxy.load_llama_from_model_settings``) constructs ``llama_cpp.Llama`` itself, so the
proxy is subclassed and that static method replaced; nothing in ``llama_cpp`` is patched. Every ``llama_cpp.Llama``
argument that has a setting of the same name is passed on, as llama-cpp-python's loader does, plus the ``kv_*``
settings. Multimodal chat handlers (they decode image embeddings outside the eviction engine), speculative decoding,
llama-cpp-python's prompt cache (a whole-context state per prompt; the conversation store replaces it) and
downloading from the Hugging Face Hub are refused with a message.
"""
from __future__ import annotations

import inspect
import json
from typing import Any, Dict, List, Optional, Union

import llama_cpp
from llama_cpp.server.model import LlamaProxy

from .conversations import ConversationLlama
from .settings import KvpModelSettings

# Settings passed on under their own name (what llama-cpp-python's loader passes, less the ones Llama ignores).
_SPECIAL = {"model_path", "kv_overrides", "draft_model", "chat_handler", "tokenizer"}
_LLAMA_ARGUMENTS = [name for name in inspect.signature(llama_cpp.Llama.__init__).parameters
                    if name in KvpModelSettings.model_fields and name not in _SPECIAL]  # fmt: skip
_KV_ARGUMENTS = ["kv_policy", "kv_budget", "kv_sink", "kv_recent", "kv_mode", "kv_head_consensus",
                 "kv_position_mode", "kv_evict_fraction", "kv_head_combine", "kv_evict_unit", "kv_seed",
                 "kv_compact_limit", "kv_max_tokens", "kv_kernel", "kv_threads", "kv_conversations",
                 "kv_conversation_memory"]  # fmt: skip
_MULTIMODAL_FORMATS = {"llava-1-5", "llava-1-6", "obsidian", "moondream", "nanollava", "llama-3-vision-alpha",
                       "minicpm-v-2.6", "qwen2.5-vl", "mtmd", "gemma4"}  # fmt: skip


def parse_kv_overrides(overrides: Optional[List[str]]) -> Optional[Dict[str, Union[bool, int, float, str]]]:
    """``key=type:value`` strings (type bool, int, float or str) as llama-cpp-python's server reads them."""
    if overrides is None:
        return None
    casts = {"bool": lambda v: v.lower() in ("true", "1"), "int": int, "float": float, "str": str}
    parsed: Dict[str, Union[bool, int, float, str]] = {}
    for override in overrides:
        key, _, value = override.partition("=")
        kind, sep, value = value.partition(":")
        if not sep or kind not in casts:
            raise ValueError(f"kv_overrides entry {override!r} is not key=type:value with type bool, int, float or str")
        parsed[key] = casts[kind](value)
    return parsed


def load_llama(settings: KvpModelSettings) -> ConversationLlama:
    """A ``ConversationLlama`` configured like llama-cpp-python's server would configure its ``Llama``."""
    if settings.clip_model_path is not None or settings.chat_format in _MULTIMODAL_FORMATS:
        raise ValueError("multimodal chat formats are not supported by kvp_cpp.server: their handlers decode image "
                         "embeddings outside the eviction engine")
    if settings.draft_model is not None:
        raise ValueError("draft_model (speculative decoding) is not supported together with a KV budget")
    if settings.cache:
        raise ValueError("--cache (llama-cpp-python's prompt cache) is replaced by the conversation store: use "
                         "kv_conversations and kv_conversation_memory")
    if settings.hf_model_repo_id is not None:
        raise ValueError("hf_model_repo_id is not supported: download the GGUF file and pass --model PATH")

    chat_handler = None
    if settings.chat_format == "hf-autotokenizer":
        if settings.hf_pretrained_model_name_or_path is None:
            raise ValueError("hf_pretrained_model_name_or_path must be set for hf-autotokenizer")
        chat_handler = llama_cpp.llama_chat_format.hf_autotokenizer_to_chat_completion_handler(
            settings.hf_pretrained_model_name_or_path
        )
    elif settings.chat_format == "hf-tokenizer-config":
        if settings.hf_tokenizer_config_path is None:
            raise ValueError("hf_tokenizer_config_path must be set for hf-tokenizer-config")
        with open(settings.hf_tokenizer_config_path) as config:
            chat_handler = llama_cpp.llama_chat_format.hf_tokenizer_config_to_chat_completion_handler(json.load(config))
    tokenizer = None
    if settings.hf_pretrained_model_name_or_path is not None:
        from llama_cpp import llama_tokenizer

        tokenizer = llama_tokenizer.LlamaHFTokenizer.from_pretrained(settings.hf_pretrained_model_name_or_path)

    arguments: Dict[str, Any] = {name: getattr(settings, name) for name in _LLAMA_ARGUMENTS + _KV_ARGUMENTS}
    llm = ConversationLlama(settings.model, kv_overrides=parse_kv_overrides(settings.kv_overrides),
                            chat_handler=chat_handler, tokenizer=tokenizer, **arguments)  # fmt: skip
    if settings.chat_template_kwargs:
        base_handler = (llm.chat_handler or llm._chat_handlers.get(llm.chat_format)
                        or llama_cpp.llama_chat_format.get_chat_completion_handler(llm.chat_format))  # fmt: skip
        extra = dict(settings.chat_template_kwargs)

        def handler_with_kwargs(*args, **kwargs):
            return base_handler(*args, **{**extra, **kwargs})

        llm.chat_handler = handler_with_kwargs
    return llm


class KvpLlamaProxy(LlamaProxy):
    """llama-cpp-python's model proxy with one model, loaded as a ``ConversationLlama``.

    One model only: the conversation states belong to it, and switching models would close it.
    """

    def __init__(self, models: List[KvpModelSettings]) -> None:
        if len(models) != 1:
            raise ValueError(f"kvp_cpp.server serves exactly one model, got {len(models)}")
        super().__init__(models)

    @staticmethod
    def load_llama_from_model_settings(settings: KvpModelSettings) -> ConversationLlama:  # type: ignore[override]
        return load_llama(settings)

    @property
    def llama(self) -> ConversationLlama:
        return self._current_model  # type: ignore[return-value]
