"""Where the patched llama.cpp for per-head KV eviction lives, and choosing it before ``llama_cpp`` loads.

``KVP_CPP_LLAMA=per_head`` in the environment makes ``import kvp_cpp`` point llama-cpp-python at the patched
libraries (``LLAMA_CPP_LIB_PATH``) before it imports ``llama_cpp``; the default, ``stock``, changes nothing. The
libraries are built by ``python -m kvp_cpp.llama_build`` into ``<cache>/llama-<key>/lib``, where the key hashes the
pinned sdist, the patch series (``kvp_cpp/llama_patches/*.patch``) and the CMake arguments. The cache root is
``$KVP_CPP_CACHE``, else ``$XDG_CACHE_HOME/kvp-cpp``, else ``~/.cache/kvp-cpp``.

Standard library only: ``kvp_cpp/__init__.py`` imports this module before ``llama_cpp``.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import sys
import warnings
from typing import Dict, List, Mapping, Optional, Sequence

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
VENDOR_PREFIX = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"

# What llama-cpp-python's own CMakeLists sets on Linux (Release, shared, OpenMP and GGML_NATIVE at their defaults),
# minus everything but the libraries. Same flags, same compiler: the unpatched code paths compute the same bits.
CMAKE_ARGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=ON",
    "-DLLAMA_BUILD_COMMON=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
    "-DGGML_CCACHE=OFF",
    # the libraries find each other in their own folder
    "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
    "-DCMAKE_INSTALL_RPATH=$ORIGIN",
]
LIBRARIES = ("libllama", "libggml", "libggml-base", "libggml-cpu")
# llama.cpp's test of the patch series (patch 0004), kept beside the libraries with the headers it needs
LLAMA_TEST_SOURCE = "test-kvp.cpp"

#: The environment variable that selects the llama.cpp build at import time: ``stock`` (default) or ``per_head``.
ENV_SELECT = "KVP_CPP_LLAMA"
BUILD_COMMAND = "python -m kvp_cpp.llama_build"


def patches_dir() -> pathlib.Path:
    return pathlib.Path(__file__).resolve().parent / "llama_patches"


def patches() -> List[pathlib.Path]:
    return sorted(patches_dir().glob("*.patch"))


def build_key() -> str:
    """Hash of everything that goes into the build: the sdist, the patch series and the CMake arguments."""
    h = hashlib.sha256()
    h.update(SDIST_SHA256.encode())
    for p in patches():
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    h.update("\0".join(CMAKE_ARGS).encode())
    return h.hexdigest()[:16]


def cache_root() -> pathlib.Path:
    if os.environ.get("KVP_CPP_CACHE"):
        return pathlib.Path(os.environ["KVP_CPP_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "kvp-cpp"


def lib_dir() -> pathlib.Path:
    """Where the patched libraries of the current patch series are (or will be)."""
    return cache_root() / f"llama-{build_key()}" / "lib"


def is_built() -> bool:
    d = lib_dir()
    return (d / "BUILD_INFO.json").is_file() and all((d / f"{name}.so").exists() for name in LIBRARIES)


def select_library() -> str:
    """Reads ``KVP_CPP_LLAMA`` and, for ``per_head``, points llama-cpp-python at the patched build.

    Called by ``kvp_cpp/__init__.py`` before it imports ``llama_cpp``. Returns the mode asked for. A missing build
    is a warning here (so that the build command itself can run); ``require_per_head()`` turns it into an error.
    """
    mode = os.environ.get(ENV_SELECT, "stock") or "stock"
    if mode not in ("stock", "per_head"):
        raise ImportError(f"{ENV_SELECT}={mode!r}: expected 'stock' or 'per_head'")
    if mode != "per_head" or "llama_cpp.llama_cpp" in sys.modules:
        return mode  # already loaded: require_per_head() tells which library it is
    if not is_built():
        warnings.warn(f"{ENV_SELECT}=per_head but the patched llama.cpp is not built ({lib_dir()}); "
                      f"using the stock one. Build it with `{BUILD_COMMAND}`", RuntimeWarning, stacklevel=3)
        return mode
    wanted = str(lib_dir())
    current = os.environ.get("LLAMA_CPP_LIB_PATH")
    if current and os.path.realpath(current) != os.path.realpath(wanted):
        raise ImportError(f"{ENV_SELECT}=per_head, but LLAMA_CPP_LIB_PATH already points at {current}, not at the "
                          f"patched build {wanted}")
    os.environ["LLAMA_CPP_LIB_PATH"] = wanted
    return mode


def child_environment(per_head: bool, base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The environment for a child Python process that should run the patched (``per_head``) or the stock llama.cpp.

    ``base`` (default ``os.environ``) without ``LLAMA_CPP_LIB_PATH``, which this process may have set when it chose
    the patched build and which would otherwise override the child's own choice, and with ``KVP_CPP_LLAMA`` set to
    ``per_head`` or removed.
    """
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if k not in ("LLAMA_CPP_LIB_PATH", ENV_SELECT)}
    if per_head:
        env[ENV_SELECT] = "per_head"
    return env


def restart_on_per_head(command: Sequence[str]) -> None:
    """Replaces this process with ``python *command`` on the patched llama.cpp, unless this process selected it
    already (a process loads one libllama for good, so a command that needs it restarts itself)."""
    if os.environ.get(ENV_SELECT) != "per_head":
        os.execve(sys.executable, [sys.executable, *command], child_environment(True))


def loaded_library_is_patched(symbol: str = "llama_kvp_enable") -> bool:
    """Whether the libllama that llama_cpp loaded has the patched functions (per-head eviction by default)."""
    module = sys.modules.get("llama_cpp.llama_cpp")
    return module is not None and hasattr(module._lib, symbol)


def require_per_head() -> None:
    """Raises RuntimeError saying what to do unless the process runs the patched llama.cpp."""
    _require_patched("llama_kvp_enable", "per-head KV eviction")


def require_graph_scoring() -> None:
    """Raises RuntimeError saying what to do unless the loaded llama.cpp can score inside the decode graph."""
    _require_patched("llama_kvp_scorer_init", "kv_scoring='graph'")


def _require_patched(symbol: str, feature: str) -> None:
    if loaded_library_is_patched(symbol):
        return
    if "llama_cpp.llama_cpp" not in sys.modules:
        raise RuntimeError("llama_cpp is not imported yet")
    if not is_built():
        how = (f"the patched llama.cpp is not built: run `{BUILD_COMMAND}` (about 3-5 minutes on 2 cores; needs "
               f"CMake and a C++17 compiler), then start Python with {ENV_SELECT}=per_head")
    elif os.environ.get(ENV_SELECT) != "per_head":
        how = f"set {ENV_SELECT}=per_head in the environment before kvp_cpp or llama_cpp is imported"
    else:
        how = ("llama_cpp was imported before kvp_cpp, with the stock library, and a loaded library cannot be "
               "swapped: import kvp_cpp first (or set LLAMA_CPP_LIB_PATH=" + str(lib_dir()) + ")")
    raise RuntimeError(f"{feature} needs the patched llama.cpp; " + how)
