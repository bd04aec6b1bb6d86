"""Writes the seed corpus of the kvp.bin loader fuzzer: small valid policy files of varied shape and dtype.

    python fuzz/make_seed_corpus.py OUT_DIR

Only numpy is needed: kvp_cpp.policy_file is loaded from the source tree, so the seeds can be made before (or
without) building the extension. Seeds stay small (a few hundred bytes to a few KiB) so that libFuzzer's mutations
land on the header and section boundaries rather than deep inside weight arrays.
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys

POLICY_FILE = pathlib.Path(__file__).resolve().parent.parent / "python" / "kvp_cpp" / "policy_file.py"

TINY = dict(arch="tiny", n_layer=2, n_head_kv=2, head_dim_k=3, head_dim_v=2, n_ctx_train=64)

# name -> random_policy arguments; every shape is written as f32 and as f16.
SHAPES = {
    "tiny": dict(TINY, hidden=(4,)),
    "no-hidden": dict(TINY, n_layer=3, hidden=()),
    "two-hidden-silu": dict(TINY, hidden=(5, 3), activation="silu"),
    "three-hidden-gelu": dict(TINY, n_layer=1, n_head_kv=1, hidden=(3, 2, 2), activation="gelu_tanh"),
    "unscored-layers-tanh": dict(TINY, arch="gemma3", n_layer=5, n_head_kv=1, activation="tanh", hidden=(2,),
                                 layer_scored=[False, True, False, False, True]),
    "no-pos-features": dict(TINY, hidden=(2,), pos=[]),
    "all-pos-kinds": dict(TINY, n_layer=1, n_head_kv=3, hidden=(2,), pos=[(0, 100.0), (1, 9.0), (2, 0.01), (3, 0.001)],
                          metadata={"text": "\u00e9\u6f22\U0001f600", "nested": {"list": [1, 2.5, None]}}),
    "one-of-everything": dict(arch="x", n_layer=1, n_head_kv=1, head_dim_k=1, head_dim_v=1, n_ctx_train=1, hidden=(),
                              pos=[], metadata={}),
}  # fmt: skip
# shapes also written with recency terms (kvp.bin version 2), and their number of knots
RECENCY_KNOTS = {"tiny": 3, "unscored-layers-tanh": 1, "one-of-everything": 32}


def load_policy_file_module():
    spec = importlib.util.spec_from_file_location("kvp_policy_file", POLICY_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=pathlib.Path)
    out_dir = parser.parse_args().out_dir
    pf = load_policy_file_module()
    out_dir.mkdir(parents=True, exist_ok=True)
    count = 0
    for seed, (name, shape) in enumerate(SHAPES.items()):
        for weight_dtype in pf.WEIGHT_DTYPES:
            data = pf.random_policy(weight_dtype=weight_dtype, seed=seed, **shape)
            variants = {name: data}
            if name in RECENCY_KNOTS:  # the same with recency terms: a version 2 file
                with_recency = pf.decode_policy(pf.encode_policy(data))
                knots = RECENCY_KNOTS[name]
                with_recency.recency = {key: [0.5 * (i - j) for j in range(knots)]
                                        for i, key in enumerate(sorted(with_recency.agents))}  # fmt: skip
                variants[f"{name}-recency"] = with_recency
            for variant, policy in variants.items():
                blob = pf.encode_policy(policy)
                pf.decode_policy(blob)  # a seed the reference reader rejects would only waste fuzzing time
                (out_dir / f"{variant}-{weight_dtype}.kvp.bin").write_bytes(blob)
                count += 1
    print(f"{count} seed files in {out_dir}")


if __name__ == "__main__":
    main()
