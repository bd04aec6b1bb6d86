"""Keeps llama.cpp off its AMX matrix kernels, which crash in the pinned version when GCC built them.

llama-cpp-python builds llama.cpp with ``-march=native``. On a CPU with AMX (Intel Sapphire Rapids and later) that
compiles ggml's AMX kernels, and GCC drops the stores that fill their tile configuration (a local array that only
the ``ldtilecfg`` instruction reads), so the first AMX tile load raises SIGILL: every model load followed by a
decode kills the process, plain ``llama_cpp.Llama`` included (upstream: ggml-org/llama.cpp pull request 26954).
The AMX kernels are reached only through llama.cpp's "extra buffer types", so where the loaded llama.cpp reports
``AMX_INT8 = 1``, models are loaded with ``use_extra_bufts = False``: weights stay in plain CPU buffers and the
ordinary AVX-512/AVX2 kernels run. kvp-bench applies the same rule (``src/bench/session.cpp``), as does the patch
series' own test. ``KVP_CPP_ALLOW_AMX=1`` keeps llama.cpp's default, for a build whose AMX kernels work.
"""
from __future__ import annotations

import os

ENV_ALLOW = "KVP_CPP_ALLOW_AMX"
MARKER = b"AMX_INT8 = 1"


def has_amx_kernels(llama_cpp_module) -> bool:
    """Whether the loaded llama.cpp was compiled with its AMX kernels (it then uses them on an AMX CPU)."""
    return MARKER in llama_cpp_module.llama_print_system_info()


def keep_models_off_amx(llama_cpp_module) -> bool:
    """Makes ``llama_model_default_params()`` ask for no extra buffer types where the AMX kernels are compiled in.

    Patches the function in ``llama_cpp`` and ``llama_cpp.llama_cpp`` (``llama_cpp.Llama`` and kvp-cpp call it
    through either), once per process. Returns whether the default changed.
    """
    low_level = llama_cpp_module.llama_cpp
    if getattr(low_level.llama_model_default_params, "keeps_off_amx", False):
        return True
    if os.environ.get(ENV_ALLOW, "") == "1" or not has_amx_kernels(llama_cpp_module):
        return False
    stock_default = low_level.llama_model_default_params

    def llama_model_default_params():
        params = stock_default()
        params.use_extra_bufts = False
        return params

    llama_model_default_params.keeps_off_amx = True
    llama_model_default_params.__doc__ = stock_default.__doc__
    low_level.llama_model_default_params = llama_model_default_params
    llama_cpp_module.llama_model_default_params = llama_model_default_params
    return True
