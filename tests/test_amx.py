"""kvp_cpp keeps llama.cpp off its AMX kernels where they are compiled in (python/kvp_cpp/_amx.py)."""
import os
import types

import llama_cpp
import pytest

import kvp_cpp  # noqa: F401  (applies the rule to the loaded llama.cpp)
from kvp_cpp import _amx

AMX_INFO = b"CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | AMX_INT8 = 1 | OPENMP = 1 | REPACK = 1 | "
PLAIN_INFO = b"CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | OPENMP = 1 | REPACK = 1 | "


def fake_llama_cpp(system_info: bytes):
    """A stand-in for the llama_cpp package: its low-level module, the re-export and the system info."""
    def stock_default():
        return llama_cpp.llama_cpp.llama_model_params(use_extra_bufts=True, use_mmap=True)

    low_level = types.SimpleNamespace(llama_model_default_params=stock_default)
    return types.SimpleNamespace(llama_cpp=low_level, llama_model_default_params=stock_default,
                                 llama_print_system_info=lambda: system_info)


def test_amx_build_loads_without_extra_buffers(monkeypatch):
    monkeypatch.delenv(_amx.ENV_ALLOW, raising=False)
    module = fake_llama_cpp(AMX_INFO)
    assert _amx.keep_models_off_amx(module)
    for default in (module.llama_model_default_params, module.llama_cpp.llama_model_default_params):
        params = default()
        assert params.use_extra_bufts is False
        assert params.use_mmap is True  # the rest of the stock defaults is kept
    patched = module.llama_cpp.llama_model_default_params
    assert _amx.keep_models_off_amx(module)  # a second import does not wrap the wrapper
    assert module.llama_cpp.llama_model_default_params is patched


@pytest.mark.parametrize("info, allow", [(PLAIN_INFO, None), (AMX_INFO, "1")])
def test_defaults_unchanged_without_amx_or_when_allowed(monkeypatch, info, allow):
    if allow is None:
        monkeypatch.delenv(_amx.ENV_ALLOW, raising=False)
    else:
        monkeypatch.setenv(_amx.ENV_ALLOW, allow)
    module = fake_llama_cpp(info)
    stock = module.llama_model_default_params
    assert not _amx.keep_models_off_amx(module)
    assert module.llama_model_default_params is stock
    assert module.llama_cpp.llama_model_default_params().use_extra_bufts is True


def test_loaded_llama_cpp_follows_the_rule():
    # what this machine's build reports decides: with AMX kernels compiled in, no extra buffer types
    compiled_in = _amx.MARKER in llama_cpp.llama_print_system_info()
    assert compiled_in == _amx.has_amx_kernels(llama_cpp)
    kept_off = compiled_in and os.environ.get(_amx.ENV_ALLOW) != "1"
    for default in (llama_cpp.llama_model_default_params, llama_cpp.llama_cpp.llama_model_default_params):
        assert default().use_extra_bufts is (not kept_off)
