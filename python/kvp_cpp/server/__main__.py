"""``python -m kvp_cpp.server [--model PATH] [--kv-policy POLICY] [--kv-budget N] [--port 8000] ...``

Every llama-cpp-python server flag is accepted (``--n_ctx``, ``--chat_format``, ``--api_key``, ``--config_file``...),
plus the ``kv_*`` settings; flags may be spelled with dashes or underscores. Environment variables and a JSON or
YAML config file (``--config_file`` or ``CONFIG_FILE``: server settings plus ``models: [one model]``) work as in
llama-cpp-python.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import sys
from typing import List, Optional, Tuple

import uvicorn
from llama_cpp.server.cli import add_args_from_model, parse_model_from_args

from .app import create_app
from .settings import KvpConfigFileSettings, KvpModelSettings, KvpServerSettings, KvpSettings

_M_MMAP_THRESHOLD = -3  # malloc.h


def underscored(argv: List[str]) -> List[str]:
    """``--kv-budget 128`` and ``--kv-budget=128`` as ``--kv_budget``: llama-cpp-python's flags are field names."""
    fields = set(KvpSettings.model_fields) | {"config_file"}
    spelled = []
    for arg in argv:
        flag, sep, value = arg.partition("=")
        if flag.startswith("--") and flag[2:].replace("-", "_") in fields:
            arg = "--" + flag[2:].replace("-", "_") + sep + value
        spelled.append(arg)
    return spelled


def read_config_file(path: str) -> Tuple[KvpServerSettings, List[KvpModelSettings]]:
    if not os.path.exists(path):
        raise ValueError(f"Config file {path} not found!")
    with open(path, "rb") as f:
        if path.endswith((".yaml", ".yml")):
            import yaml

            config = KvpConfigFileSettings.model_validate_json(json.dumps(yaml.safe_load(f)))
        else:
            config = KvpConfigFileSettings.model_validate_json(f.read())
    server = KvpServerSettings(**{name: getattr(config, name) for name in KvpServerSettings.model_fields})
    return server, config.models


def fix_mmap_threshold() -> None:
    """Serves large allocations (saved conversation states, megabytes each, made and freed on every switch) with
    mmap. glibc raises its mmap threshold to the size of each large block freed, after which such blocks come from
    the heap, fragment it and keep the server's RSS growing; setting the threshold explicitly turns that off."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, 256 * 1024)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m kvp_cpp.server",
        description="OpenAI-compatible chat server (llama-cpp-python's) whose KV cache stays within kv_budget cells.",
    )
    add_args_from_model(parser, KvpSettings)
    parser.add_argument("--config_file", type=str, help="Path to a config file to load.")
    args = parser.parse_args(underscored(sys.argv[1:] if argv is None else argv))
    try:
        config_file = os.environ.get("CONFIG_FILE", args.config_file)
        if config_file:
            server_settings, model_settings = read_config_file(config_file)
        else:
            server_settings = parse_model_from_args(KvpServerSettings, args)
            model_settings = [parse_model_from_args(KvpModelSettings, args)]
    except Exception as error:
        print(error, file=sys.stderr)
        sys.exit(2)
    fix_mmap_threshold()
    try:
        app = create_app(server_settings=server_settings, model_settings=model_settings)
    except (ValueError, RuntimeError) as error:  # the model and its kv_* settings, refused when loading
        print(f"python -m kvp_cpp.server: {error}", file=sys.stderr)
        sys.exit(2)
    uvicorn.run(app, host=server_settings.host, port=server_settings.port, ssl_keyfile=server_settings.ssl_keyfile,
                ssl_certfile=server_settings.ssl_certfile)


if __name__ == "__main__":
    main()
