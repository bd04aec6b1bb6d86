"""kvp-cpp: learned KV-cache eviction (KV Policy) for llama.cpp."""
from __future__ import annotations

# KVP_CPP_LLAMA=per_head points llama-cpp-python at the patched llama.cpp (LLAMA_CPP_LIB_PATH) before it is loaded;
# _llama_lib imports only the standard library.
from ._llama_lib import select_library as _select_library

_select_library()

# llama_cpp must be imported before the extension: it loads libllama/libggml (ctypes, RTLD_LOCAL) from
# llama_cpp/lib (or LLAMA_CPP_LIB_PATH), and the extension then binds to that same copy by SONAME instead of
# loading a second one.
import llama_cpp as _llama_cpp  # noqa: F401,E402  (import order matters)

from ._amx import keep_models_off_amx as _keep_models_off_amx

_keep_models_off_amx(_llama_cpp)

from . import _core
from ._build_check import check_llama_cpp_build as _check_llama_cpp_build

_check_llama_cpp_build(_core, _llama_cpp)
from ._core import PolicyFormatError, Scorer, available_kernels, load_policy, parse_policy, selected_kernel
from ._paths import default_model_path
from .shipped import shipped_policies, shipped_policy_for
from .llama import KvpLlamaState, Llama, builtin_policies, model_identity

__version__ = "0.1.0"

__all__ = [
    "KvpLlamaState",
    "Llama",
    "builtin_policies",
    "PolicyFormatError",
    "Scorer",
    "available_kernels",
    "default_model_path",
    "load_policy",
    "model_identity",
    "parse_policy",
    "selected_kernel",
    "shipped_policies",
    "shipped_policy_for",
]
