"""Policies shipped with kvp-cpp: models/*.kvp.bin in the repository, installed into the package's models/ folder.

``kv_policy="kvp"`` picks the shipped policy trained for the model in use.
"""
from __future__ import annotations

import os
from typing import Dict

from . import _core

SHIPPED_NAME = "kvp"


def shipped_dir() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "models")


def shipped_policies() -> Dict[str, str]:
    """{name: path} of every shipped policy (name = file name without .kvp.bin)."""
    folder = shipped_dir()
    if not os.path.isdir(folder):
        return {}
    return {name[: -len(".kvp.bin")]: os.path.join(folder, name)
            for name in sorted(os.listdir(folder)) if name.endswith(".kvp.bin")}


def shipped_policy_for(identity: Dict) -> str:
    """The shipped policy trained for a model with this identity (see kvp_cpp.model_identity)."""
    for path in shipped_policies().values():
        if dict(_core.load_policy(path).identity) == dict(identity):
            return path
    described = ", ".join(f"{k}={v}" for k, v in identity.items())
    shipped = ", ".join(shipped_policies()) or "none"
    raise ValueError(f"no shipped KVP policy matches this model ({described}); shipped: {shipped}. Train one with "
                     "python -m training.train (see README) and pass its path as kv_policy")
