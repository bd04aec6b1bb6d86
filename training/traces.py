"""Reader (and a synthetic writer, for tests) of the training-trace layout of docs/traces.md.

    traces = TraceSet("traces-smollm2")
    for sample in traces.samples("train"):      # one LayerTrace per (sequence, cut, layer)
        sample.k, sample.v, sample.positions, sample.importance

The arrays are memory-mapped; a LayerTrace holds float32 copies of one layer of one cached prefix.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import numpy as np

__all__ = [
    "TRACE_VERSION",
    "comma_names",
    "SPLITS",
    "TraceFormatError",
    "LayerTrace",
    "SequenceInfo",
    "TraceSet",
    "SyntheticTruth",
    "write_synthetic_traces",
]

TRACE_VERSION = 1
SPLITS = ("train", "heldout")
_MODEL_FIELDS = ("arch", "n_layer", "n_head_kv", "head_dim_k", "head_dim_v", "n_ctx_train")


class TraceFormatError(ValueError):
    """A trace directory does not follow docs/traces.md."""


@dataclass
class LayerTrace:
    """One layer of one cached prefix: tokens 0 … cut−1 of a sequence, every KV head of the layer."""

    sequence_id: int
    cut: int
    layer: int
    k: np.ndarray  # (n_head_kv, cut, head_dim_k) float32, post-RoPE
    v: np.ndarray  # (n_head_kv, cut, head_dim_v) float32
    positions: np.ndarray  # (cut,) int64, original positions
    importance: np.ndarray  # (n_head_kv, cut) float32


@dataclass(frozen=True)
class SequenceInfo:
    id: int
    dir: str
    source: str
    document: str
    split: str
    n_tokens: int
    cuts: tuple
    has_q: bool
    futures: tuple = ()  # future queries behind each cut; n_future each when the manifest gives none


class TraceSet:
    """A trace directory: its manifest, and memory-mapped K, V and importance per sequence."""

    def __init__(self, root):
        self.root = os.fspath(root)
        manifest_path = os.path.join(self.root, "manifest.json")
        try:
            with open(manifest_path, encoding="utf-8") as f:
                manifest = json.load(f)
        except (OSError, ValueError) as e:
            raise TraceFormatError(f"cannot read {manifest_path}: {e}") from e
        if manifest.get("version") != TRACE_VERSION:
            raise TraceFormatError(f"{manifest_path}: version {manifest.get('version')!r}, expected {TRACE_VERSION}")
        self.model = dict(manifest["model"])
        for name in _MODEL_FIELDS:
            if name not in self.model:
                raise TraceFormatError(f"{manifest_path}: model.{name} is missing")
        self.n_future = int(manifest["n_future"])
        self.sequences = [self._sequence_info(entry) for entry in manifest["sequences"]]
        if len({s.id for s in self.sequences}) != len(self.sequences):
            raise TraceFormatError(f"{manifest_path}: sequence ids are not unique")
        self._maps = {}

    @property
    def arch(self) -> str:
        return self.model["arch"]

    @property
    def n_layer(self) -> int:
        return int(self.model["n_layer"])

    @property
    def n_head_kv(self) -> int:
        return int(self.model["n_head_kv"])

    @property
    def head_dim_k(self) -> int:
        return int(self.model["head_dim_k"])

    @property
    def head_dim_v(self) -> int:
        return int(self.model["head_dim_v"])

    @property
    def n_ctx_train(self) -> int:
        return int(self.model["n_ctx_train"])

    @property
    def sliding_window(self) -> int:
        """Tokens a sliding-window layer attends to (0: the model has none)."""
        return int(self.model.get("sliding_window", 0))

    @property
    def global_layers(self) -> list:
        """The layers that attend to the whole context: where eviction decides what attention loses."""
        sliding = set(self.model.get("sliding_layers", []))
        return [layer for layer in range(self.n_layer) if layer not in sliding]

    def identity(self) -> dict:
        """The model identity fields of a kvp.bin policy for this model."""
        return {name: self.model[name] for name in _MODEL_FIELDS}

    def _sequence_info(self, entry: dict) -> SequenceInfo:
        info = SequenceInfo(
            id=int(entry["id"]),
            dir=str(entry["dir"]),
            source=str(entry.get("source", "")),
            document=str(entry.get("document", "")),
            split=str(entry["split"]),
            n_tokens=int(entry["n_tokens"]),
            cuts=tuple(int(c) for c in entry["cuts"]),
            has_q=bool(entry.get("has_q", False)),
            futures=tuple(int(f) for f in entry.get("futures", [self.n_future] * len(entry["cuts"]))),
        )
        where = f"sequence {info.id} ({info.dir})"
        if info.split not in SPLITS:
            raise TraceFormatError(f"{where}: split {info.split!r} is not one of {SPLITS}")
        if len(info.futures) != len(info.cuts):
            raise TraceFormatError(f"{where}: {len(info.futures)} futures for {len(info.cuts)} cuts")
        for cut, future in zip(info.cuts, info.futures):
            if future < 1 or not 1 <= cut <= info.n_tokens - future:
                raise TraceFormatError(
                    f"{where}: cut {cut} with {future} future queries does not fit in its {info.n_tokens} tokens"
                )
        return info

    def sequence_indices(self, split: Optional[str] = None) -> list:
        """Indices into self.sequences of one split (or all)."""
        if split is not None and split not in SPLITS:
            raise ValueError(f"split {split!r} is not one of {SPLITS}")
        return [i for i, s in enumerate(self.sequences) if split is None or s.split == split]

    def sequences_of(self, split: str, sources: Optional[Sequence[str]] = None) -> list:
        """Indices of one split's sequences, of the given sources only (all if sources is None); a source the
        split does not have is an error that lists those it has."""
        indices = self.sequence_indices(split)
        if sources is None:
            return indices
        available = sorted({self.sequences[i].source for i in indices})
        if not sources or any(source not in available for source in sources):
            raise ValueError(f"sources {','.join(sources)}: the {split} split has the sources {','.join(available)}")
        return [i for i in indices if self.sequences[i].source in sources]

    def prefixes(self, split: Optional[str] = None) -> list:
        """(sequence index, cut) of every cached prefix of one split (or all), in manifest order."""
        return [(i, cut) for i in self.sequence_indices(split) for cut in self.sequences[i].cuts]

    def _open(self, index: int):
        """(k, v, importance) memory maps of a sequence, checked against the manifest's sizes."""
        if index in self._maps:
            return self._maps[index]
        info = self.sequences[index]
        directory = os.path.join(self.root, info.dir)
        shapes = {
            "k.f16": (np.float16, (self.n_layer, info.n_tokens, self.n_head_kv, self.head_dim_k)),
            "v.f16": (np.float16, (self.n_layer, info.n_tokens, self.n_head_kv, self.head_dim_v)),
            "importance.f32": (np.float32, (self.n_layer * self.n_head_kv * sum(info.cuts),)),
        }
        maps = []
        for name, (dtype, shape) in shapes.items():
            path = os.path.join(directory, name)
            expected = math.prod(shape) * np.dtype(dtype).itemsize
            try:
                actual = os.path.getsize(path)
            except OSError as e:
                raise TraceFormatError(f"sequence {info.id}: cannot read {path}: {e.strerror or e}") from e
            if actual != expected:
                raise TraceFormatError(f"sequence {info.id}: {path} is {actual} bytes, the manifest implies {expected}")
            maps.append(np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r", shape=shape))
        self._maps[index] = tuple(maps)
        return self._maps[index]

    def keys(self, index: int) -> np.ndarray:
        """The memory-mapped (n_layer, n_tokens, n_head_kv, head_dim_k) float16 keys of a sequence."""
        return self._open(index)[0]

    def values(self, index: int) -> np.ndarray:
        """The memory-mapped (n_layer, n_tokens, n_head_kv, head_dim_v) float16 values of a sequence."""
        return self._open(index)[1]

    def read(self, index: int, cut: int, layer: int) -> LayerTrace:
        """One layer of the prefix of sequence `index` (an index into self.sequences) cached up to `cut`."""
        info = self.sequences[index]
        if cut not in info.cuts:
            raise ValueError(f"sequence {info.id} has no cut {cut} (cuts {list(info.cuts)})")
        if not 0 <= layer < self.n_layer:
            raise ValueError(f"layer {layer} is outside 0..{self.n_layer - 1}")
        k, v, importance = self._open(index)
        cut_offset = self.n_layer * self.n_head_kv * sum(info.cuts[: info.cuts.index(cut)])
        start = cut_offset + layer * self.n_head_kv * cut
        return LayerTrace(
            sequence_id=info.id,
            cut=cut,
            layer=layer,
            k=np.ascontiguousarray(k[layer, :cut].transpose(1, 0, 2), dtype=np.float32),
            v=np.ascontiguousarray(v[layer, :cut].transpose(1, 0, 2), dtype=np.float32),
            positions=np.arange(cut, dtype=np.int64),
            importance=np.array(importance[start : start + self.n_head_kv * cut], dtype=np.float32).reshape(
                self.n_head_kv, cut
            ),
        )

    def read_prefix(self, index: int, cut: int, layers: Optional[Sequence[int]] = None) -> list:
        """The LayerTraces of several layers (default all) of one prefix."""
        return [self.read(index, cut, layer) for layer in (range(self.n_layer) if layers is None else layers)]

    def samples(self, split: Optional[str] = None, layers: Optional[Sequence[int]] = None) -> Iterator[LayerTrace]:
        """Every (sequence, cut, layer) of one split (or all), in manifest order."""
        for index, cut in self.prefixes(split):
            yield from self.read_prefix(index, cut, layers)


# --- synthetic traces with a planted ranking (tests) ----------------------------------------------------------------


@dataclass
class SyntheticTruth:
    """What write_synthetic_traces wrote, in memory, for checking a reader or a learner against it."""

    queries: np.ndarray  # (n_layer, n_head_kv, head_dim): the planted query direction of each (layer, KV head)
    keys: list  # per sequence: (n_layer, n_tokens, n_head_kv, head_dim) float16
    values: list  # per sequence: (n_layer, n_tokens, n_head_kv, head_dim) float16
    importance: list  # per sequence: {cut: (n_layer, n_head_kv, cut) float32}
    splits: list  # per sequence: "train" or "heldout"


def comma_names(text: str) -> list:
    """A command line's comma-separated names, e.g. --sources chats,text."""
    return [part.strip() for part in text.split(",") if part.strip()]


def write_synthetic_traces(
    root,
    *,
    n_sequences: int = 8,
    n_tokens: int = 192,
    cuts: Sequence[int] = (64, 96, 128),
    n_layer: int = 2,
    n_head_kv: int = 2,
    head_dim: int = 8,
    n_future: int = 32,
    heldout_every: int = 4,
    logit_std: float = 1.5,
    seed: int = 0,
) -> SyntheticTruth:
    """A small valid trace set whose importance is a known function of the key alone.

    Each (layer, KV head) has a fixed query direction q; a cached token's importance is the attention that
    n_future copies of q pay it: I_i = n_future · softmax_i(q · k_i / sqrt(d)) over the cached tokens, the logits
    having a standard deviation of logit_std. The best ranking is therefore the order of the linear function q · k.
    Keys have per-dimension offsets and scales (as real keys do) so that input normalisation matters. Every
    `heldout_every`-th sequence is held out.
    """
    rng = np.random.default_rng(seed)
    shape = (n_layer, n_tokens, n_head_kv, head_dim)
    key_offset = rng.standard_normal((n_layer, 1, n_head_kv, head_dim)) * 2.0
    key_scale = rng.uniform(0.5, 2.0, (n_layer, 1, n_head_kv, head_dim))
    queries = rng.standard_normal((n_layer, n_head_kv, head_dim))
    # Scaled so that the attention logits q·k/sqrt(d) have a standard deviation of logit_std over the keys.
    logit_spread = np.linalg.norm(queries * key_scale[:, 0], axis=-1, keepdims=True) / math.sqrt(head_dim)
    queries *= logit_std / logit_spread
    os.makedirs(root, exist_ok=True)
    truth = SyntheticTruth(queries=queries, keys=[], values=[], importance=[], splits=[])
    entries = []
    for index in range(n_sequences):
        directory = f"seq_{index:05d}"
        os.makedirs(os.path.join(root, directory), exist_ok=True)
        split = "heldout" if (index + 1) % heldout_every == 0 else "train"
        keys = (key_offset + key_scale * rng.standard_normal(shape)).astype(np.float16)
        values = rng.standard_normal(shape).astype(np.float16)
        # Logits from the stored (float16) keys, so the planted order is exact for what a reader sees.
        logits = np.einsum("ltgd,lgd->lgt", keys.astype(np.float64), queries) / math.sqrt(head_dim)
        importance = {}
        for cut in cuts:
            weights = np.exp(logits[:, :, :cut] - logits[:, :, :cut].max(axis=-1, keepdims=True))
            importance[cut] = (n_future * weights / weights.sum(axis=-1, keepdims=True)).astype(np.float32)
        files = {
            "tokens.i32": rng.integers(0, 32000, n_tokens).astype("<i4"),
            "k.f16": keys.astype("<f2"),
            "v.f16": values.astype("<f2"),
            "importance.f32": np.concatenate([importance[cut].reshape(-1) for cut in cuts]).astype("<f4"),
        }
        for name, array in files.items():
            array.tofile(os.path.join(root, directory, name))
        truth.keys.append(keys)
        truth.values.append(values)
        truth.importance.append(importance)
        truth.splits.append(split)
        entries.append(
            {"id": index, "dir": directory, "source": "synthetic", "document": f"planted/{index}", "split": split,
             "n_tokens": n_tokens, "cuts": list(cuts), "has_q": False}
        )  # fmt: skip
    manifest = {
        "version": TRACE_VERSION,
        "model": {"arch": "synthetic", "n_layer": n_layer, "n_head_kv": n_head_kv, "head_dim_k": head_dim,
                  "head_dim_v": head_dim, "n_ctx_train": n_tokens, "n_head": n_head_kv, "path": "",
                  "sha256_16": ""},
        "n_future": n_future,
        "sequences": entries,
    }  # fmt: skip
    with open(os.path.join(root, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
    return truth
