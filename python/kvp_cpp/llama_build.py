"""Builds the patched llama.cpp that per-head KV eviction needs (``KVP_CPP_LLAMA=per_head``).

The source is the llama.cpp that the pinned llama-cpp-python sdist carries (``vendor/llama.cpp``), fetched from the
package registry with ``pip download`` and checked against its SHA-256. The patch series in
``kvp_cpp/llama_patches/*.patch`` is applied in name order, and the shared libraries (libllama, libggml,
libggml-base, libggml-cpu) are built for the CPU into ``<cache>/llama-<key>/lib`` (see ``kvp_cpp._llama_lib``).
A finished build is reused.

    python -m kvp_cpp.llama_build            # build (or reuse) and print the folder
    python -m kvp_cpp.llama_build --print    # print the folder if built, else exit 1
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import List, Optional

from ._llama_lib import (BUILD_COMMAND, CMAKE_ARGS, LIBRARIES, LLAMA_CPP_PYTHON_VERSION, LLAMA_TEST_SOURCE, SDIST_NAME,
                         SDIST_SHA256, VENDOR_PREFIX, cache_root, is_built, lib_dir, patches)


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_sdist(dest: pathlib.Path) -> pathlib.Path:
    """The pinned sdist, downloaded with pip into ``dest`` unless a copy with the right hash is already there."""
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / SDIST_NAME
    if not path.is_file() or _sha256(path) != SDIST_SHA256:
        # --no-binary names the one package: with :all:, pip would also build the sdist's build requirements
        # (cmake among them) from source to read its metadata, which takes longer than the llama.cpp build.
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-binary", "llama-cpp-python", "--no-deps",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(dest)], check=True)
    digest = _sha256(path)
    if digest != SDIST_SHA256:
        raise RuntimeError(f"{path}: SHA-256 {digest}, expected {SDIST_SHA256}")
    return path


def extract_llama_cpp(sdist: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
    """Extracts ``vendor/llama.cpp`` of the sdist, and the sdist's ``.git`` that its ``.git`` file points into.

    With the git metadata, ggml records the same commit string as llama-cpp-python's own build (``0c1e570-dirty``),
    which kvp-cpp's extension checks at import time.
    """
    top = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers()
                   if (m.name.startswith(VENDOR_PREFIX) or m.name.startswith(top + ".git/"))
                   and (m.isfile() or m.isdir())]
        tar.extractall(dest, members=members)
    return dest / VENDOR_PREFIX


def apply_patches(src: pathlib.Path) -> None:
    for p in patches():
        if shutil.which("patch"):
            subprocess.run(["patch", "-p1", "--batch", "--forward", "--quiet", "-i", str(p)], cwd=src, check=True)
        elif shutil.which("git"):  # minimal images have git (the repository came with it) but not always patch
            subprocess.run(["git", "apply", "-p1", str(p)], cwd=src, check=True)
        else:
            raise SystemExit("kvp_cpp.llama_build: neither `patch` nor `git` is installed; install one of them")


def cmake_command() -> str:
    """CMake from PATH, else from the `cmake` package of PyPI (pip install cmake)."""
    found = shutil.which("cmake")
    if found:
        return found
    try:
        import cmake  # the PyPI wheel: CMake's binaries inside the package

        return os.path.join(cmake.CMAKE_BIN_DIR, "cmake")
    except ImportError:
        raise SystemExit("kvp_cpp.llama_build needs CMake >= 3.21: pip install cmake (or install it from your "
                         "distribution)") from None


def generator_args() -> List[str]:
    """CMake's default generator (make) when make is installed, else Ninja (from PATH or PyPI's `ninja`)."""
    if shutil.which("make"):
        return []
    ninja = shutil.which("ninja")
    if not ninja:
        try:
            import ninja as ninja_package

            ninja = os.path.join(ninja_package.BIN_DIR, "ninja")
        except ImportError:
            raise SystemExit("kvp_cpp.llama_build needs make or Ninja: pip install ninja") from None
    return ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]


def _run_verbose(cmd: List[str]) -> None:
    subprocess.run(cmd, check=True)


def _run_quiet(cmd: List[str]) -> None:
    """Runs a build step silently (llama.cpp's compiler warnings fill thousands of lines); on failure, shows the end
    of its output."""
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    if done.returncode != 0:
        sys.stderr.write("\n".join(done.stdout.splitlines()[-60:]) + "\n")
        raise subprocess.CalledProcessError(done.returncode, cmd)


def build(jobs: int = 2, verbose: bool = False) -> pathlib.Path:
    """Builds the patched libraries unless this patch series is already built; returns their folder."""
    out = lib_dir()
    if is_built():
        return out
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    sdist = fetch_sdist(root / "sdist")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="build-", dir=root) as tmp:
        tmp = pathlib.Path(tmp)
        src = extract_llama_cpp(sdist, tmp)
        apply_patches(src)
        bld = tmp / "build"
        cmake = cmake_command()
        run = _run_verbose if verbose else _run_quiet
        run([cmake, "-S", str(src), "-B", str(bld), *generator_args(), *CMAKE_ARGS])
        run([cmake, "--build", str(bld), "-j", str(jobs), "--target", "llama"])
        stage = tmp / "lib"
        stage.mkdir()
        for f in sorted((bld / "bin").iterdir()):
            if any(f.name.startswith(name + ".so") for name in LIBRARIES):
                shutil.copy2(f, stage / f.name, follow_symlinks=False)
        # the headers, and the series' own llama.cpp test (tests/test_per_head.py compiles it against the libraries)
        (stage / "include").mkdir()
        for header in [src / "include" / "llama.h", *sorted((src / "ggml" / "include").glob("*.h"))]:
            shutil.copy2(header, stage / "include" / header.name)
        shutil.copy2(src / "tests" / LLAMA_TEST_SOURCE, stage / LLAMA_TEST_SOURCE)
        info = {"llama_cpp_python": LLAMA_CPP_PYTHON_VERSION, "sdist_sha256": SDIST_SHA256,
                "patches": [p.name for p in patches()], "cmake_args": CMAKE_ARGS, "jobs": jobs,
                "build_seconds": round(time.monotonic() - t0, 1)}
        (stage / "BUILD_INFO.json").write_text(json.dumps(info, indent=1) + "\n")
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():  # an unfinished earlier build
            shutil.rmtree(out)
        os.replace(stage, out)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog=BUILD_COMMAND, description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", "-j", type=int, default=2)
    ap.add_argument("--print", action="store_true", help="print the library folder if built, else exit 1")
    ap.add_argument("--verbose", "-v", action="store_true")
    args = ap.parse_args(argv)
    if args.print:
        if not is_built():
            print(f"not built: {lib_dir()}", file=sys.stderr)
            return 1
        print(lib_dir())
        return 0
    t0 = time.monotonic()
    out = build(jobs=args.jobs, verbose=args.verbose)
    print(out)
    print(f"({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
