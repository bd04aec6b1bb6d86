"""``python -m kvp_cpp.server``: an OpenAI-compatible chat server whose KV cache stays within ``kv_budget`` cells.

llama-cpp-python's server (FastAPI/uvicorn, its settings, CLI and router) with a policy-driven model, continuing
conversations recognised across evictions, and one saved state per conversation. See docs/server.md. Needs the
``server`` extra: ``pip install 'kvp-cpp[server]'``.
"""
from __future__ import annotations

from .app import create_app
from .conversations import ConversationLlama, ConversationStore
from .settings import KvpConfigFileSettings, KvpModelSettings, KvpServerSettings, KvpSettings

__all__ = ["ConversationLlama", "ConversationStore", "KvpConfigFileSettings", "KvpModelSettings",
           "KvpServerSettings", "KvpSettings", "create_app"]  # fmt: skip
