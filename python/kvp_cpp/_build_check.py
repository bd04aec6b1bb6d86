"""Refuse to run against a llama.cpp other than the one the extension was compiled against."""
from __future__ import annotations

import hashlib
import os


def check_llama_cpp_build(core, llama_cpp_module) -> None:
    """Compares llama-cpp-python's version, the loaded libggml's commit and llama.h's hash with the build's.

    The extension calls llama.cpp through its C ABI and reads ggml_tensor fields directly, so a different
    llama.cpp build can corrupt memory instead of failing cleanly.
    """
    built = core.build_info()
    found = {
        "llama_cpp_python": getattr(llama_cpp_module, "__version__", "unknown"),
        "ggml_commit": core.runtime_ggml_commit(),
    }
    header = os.path.join(os.path.dirname(os.path.dirname(llama_cpp_module.__file__)), "include", "llama.h")
    if os.path.isfile(header):
        with open(header, "rb") as f:
            found["llama_h_sha256"] = hashlib.sha256(f.read()).hexdigest()
    differing = [f"{key}: built against {built[key]}, found {value}" for key, value in found.items()
                 if value != built[key]]
    if differing:
        raise ImportError(
            "kvp-cpp was compiled against another llama.cpp than the one installed (" + "; ".join(differing) +
            "). Reinstall kvp-cpp so that it builds against this llama-cpp-python: "
            "pip install --force-reinstall --no-deps --no-cache-dir kvp-cpp (or reinstall llama-cpp-python=="
            f"{built['llama_cpp_python']})"
        )
