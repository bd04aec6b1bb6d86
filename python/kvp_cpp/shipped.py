"""Policies shipped with kvp-cpp: models/*.kvp.bin in the repository, installed into the package's models/ folder.

``kv_policy="kvp"`` picks the shipped policy trained for the model in use (``MODEL.kvp.bin``); ``"kvp-chat"`` picks
its chat policy (``MODEL.chat.kvp.bin``), trained on conversations only, as the paper's KVP_S is.
"""
from __future__ import annotations

import os
from typing import Dict

from . import _core

SHIPPED_NAME = "kvp"
# kv_policy name -> the variant in the file name (MODEL.VARIANT.kvp.bin; "" for MODEL.kvp.bin)
SHIPPED_VARIANTS = {SHIPPED_NAME: "", "kvp-chat": "chat"}


def shipped_dir() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "models")


def shipped_policies() -> Dict[str, str]:
    """{name: path} of every shipped policy (name = file name without .kvp.bin)."""
    folder = shipped_dir()
    if not os.path.isdir(folder):
        return {}
    return {name[: -len(".kvp.bin")]: os.path.join(folder, name)
            for name in sorted(os.listdir(folder)) if name.endswith(".kvp.bin")}


def _variant(name: str) -> str:
    return name.rsplit(".", 1)[1] if "." in name else ""


def shipped_policy_for(identity: Dict, variant: str = "") -> str:
    """The shipped policy of this variant ("" or "chat") trained for a model with this identity (see
    kvp_cpp.model_identity)."""
    if variant not in SHIPPED_VARIANTS.values():
        raise ValueError(f"unknown shipped policy variant {variant!r}: use one of "
                         f"{', '.join(repr(v) for v in SHIPPED_VARIANTS.values())}")
    for name, path in shipped_policies().items():
        if _variant(name) == variant and dict(_core.load_policy(path).identity) == dict(identity):
            return path
    described = ", ".join(f"{k}={v}" for k, v in identity.items())
    shipped = ", ".join(shipped_policies()) or "none"
    kind = f"KVP {variant} policy" if variant else "KVP policy"
    raise ValueError(f"no shipped {kind} matches this model ({described}); shipped: {shipped}. Train one with "
                     "python -m training.train (see README) and pass its path as kv_policy")


def resolve_shipped_name(name: str, identity: Dict) -> str:
    """The path of the shipped policy that a kv_policy name such as "kvp" or "kvp-chat" stands for."""
    return shipped_policy_for(identity, SHIPPED_VARIANTS[name])
