"""Pure-numpy reader and writer of the ``kvp.bin`` policy format (docs/kvp-bin-format.md).

The checks and their order mirror the C++ loader (src/format.cpp), so both name the same problem for a bad file.
The one difference: this reader parses the metadata with ``json.loads``; the C++ one only checks it is UTF-8 with
``{`` ... ``}`` around it.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
import zlib
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

__all__ = [
    "PolicyFormatError",
    "Agent",
    "PolicyData",
    "ACTIVATIONS",
    "WEIGHT_DTYPES",
    "POS_FEATURE_KINDS",
    "encode_policy",
    "decode_policy",
    "write_policy",
    "read_policy",
    "default_pos_features",
    "pos_features",
    "random_policy",
    "smollm2_identity",
    "reference_scores",
    "recency_terms",
]

MAGIC = b"KVPOLICY"
VERSION = 2  # the newest version; a policy without a recency term is written as version 1
SUPPORTED_VERSIONS = (1, 2)
MAX_RECENCY_KNOTS = 32
HEADER_BYTES = 128
CHECKSUM_BYTES = 4
POS_FEATURE_BYTES = 8
MAX_POS_FEATURES = 16
MAX_DENSE = 4
MAX_HIDDEN = 4096
MAX_METADATA_BYTES = 16 << 20
MAX_FILE_BYTES = 2 << 30
U32_MAX = 0xFFFFFFFF

ACTIVATIONS = ("relu", "silu", "gelu_tanh", "tanh")
WEIGHT_DTYPES = ("f32", "f16")
POS_FEATURE_KINDS = ("linear", "log", "sine", "cosine")
_NUMPY_DTYPES = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2")}

# magic, version, header_bytes, file_bytes, arch, n_layer, n_head_kv, head_dim_k, head_dim_v, n_ctx_train,
# n_pos_features, n_dense, hidden[3], activation, weight_dtype, n_sink, n_recent, metadata_bytes,
# n_recency_knots (version 2; reserved, zero, in version 1), reserved
_HEADER = struct.Struct("<8sIIQ32s7I3I4IQII")
assert _HEADER.size == HEADER_BYTES
_HEADER_NAMES = (
    "magic", "version", "header_bytes", "file_bytes", "arch", "n_layer", "n_head_kv", "head_dim_k", "head_dim_v",
    "n_ctx_train", "n_pos_features", "n_dense", "hidden0", "hidden1", "hidden2", "activation", "weight_dtype",
    "n_sink", "n_recent", "metadata_bytes", "n_recency_knots", "reserved",
)  # fmt: skip
_ARCH_BYTES = 32
_JSON_WHITESPACE = " \t\n\r"

# The header fields with a plain range, in the order both readers check them (writer and reader share this table).
_RANGED_FIELDS = (
    ("n_layer", 1, 1024),
    ("n_head_kv", 1, 256),
    ("head_dim_k", 1, 1024),
    ("head_dim_v", 1, 1024),
    ("n_ctx_train", 1, U32_MAX),
    ("n_pos_features", 0, MAX_POS_FEATURES),
    ("n_dense", 1, MAX_DENSE),
    ("activation", 0, len(ACTIVATIONS) - 1),
    ("weight_dtype", 0, len(WEIGHT_DTYPES) - 1),
    ("n_sink", 0, U32_MAX),
    ("n_recent", 0, U32_MAX),
)


class PolicyFormatError(ValueError):
    """A policy file (or a PolicyData about to be written) does not follow the kvp.bin format."""


@dataclass
class Agent:
    """The MLP of one (layer, KV head). weights[j] is (n_out, n_in); weights and biases keep their stored dtype."""

    shift: np.ndarray
    scale: np.ndarray
    weights: list
    biases: list


@dataclass
class PolicyData:
    arch: str
    n_layer: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_ctx_train: int
    pos_features: list  # [(kind, a)], a as the f32 value it is stored as
    hidden: list  # n_dense - 1 widths
    activation: str  # one of ACTIVATIONS
    weight_dtype: str  # one of WEIGHT_DTYPES
    n_sink: int = 4
    n_recent: int = 16
    layer_scored: list = field(default_factory=list)  # n_layer bools
    agents: dict = field(default_factory=dict)  # (layer, head) -> Agent, for scored layers only
    metadata: dict = field(default_factory=dict)
    # (layer, head) -> the learned recency term's values at ages 2^0 … 2^(K−1) (recency_terms), for every scored
    # agent or for none; empty: no recency term (a version 1 file)
    recency: dict = field(default_factory=dict)

    def identity(self) -> dict:
        return {
            "arch": self.arch,
            "n_layer": self.n_layer,
            "n_head_kv": self.n_head_kv,
            "head_dim_k": self.head_dim_k,
            "head_dim_v": self.head_dim_v,
            "n_ctx_train": self.n_ctx_train,
        }

    @property
    def input_dim(self) -> int:
        return self.head_dim_k + self.head_dim_v + len(self.pos_features)

    @property
    def n_recency_knots(self) -> int:
        return len(next(iter(self.recency.values()))) if self.recency else 0


# --- checks shared by the writer and the reader ------------------------------------------------------------------


def _fail(message: str):
    raise PolicyFormatError(message)


def _check_ranged_fields(fields: dict) -> None:
    for name, lo, hi in _RANGED_FIELDS:
        value = fields[name]
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not lo <= value <= hi:
            _fail(f"{name}={value!r} is outside {lo}..{hi}")


def _check_hidden(n_dense: int, hidden: Sequence[int]) -> None:
    """hidden has MAX_DENSE - 1 entries: the used ones 1..MAX_HIDDEN, the rest 0."""
    for j, width in enumerate(hidden):
        if j + 1 < n_dense:
            if not isinstance(width, (int, np.integer)) or not 1 <= width <= MAX_HIDDEN:
                _fail(f"hidden[{j}]={width!r} is outside 1..{MAX_HIDDEN}")
        elif width != 0:
            _fail(f"hidden[{j}]={width!r} must be 0 (n_dense={n_dense})")


def _check_metadata_bytes(metadata_bytes: int) -> None:
    if metadata_bytes > MAX_METADATA_BYTES:
        _fail(f"metadata_bytes={metadata_bytes} is more than {MAX_METADATA_BYTES}")


def _check_arch_bytes(raw: bytes) -> str:
    nul = raw.find(b"\0")
    if nul < 0:
        _fail(f"arch has no NUL terminator within its {_ARCH_BYTES} bytes")
    if nul == 0:
        _fail("arch is empty")
    if raw[nul:].count(0) != len(raw) - nul:
        _fail("arch is not NUL-padded after its terminator")
    try:
        return raw[:nul].decode("utf-8")
    except UnicodeDecodeError:
        _fail("arch is not valid UTF-8")


def _check_layer_flags(flags: Sequence[int]) -> None:
    for layer, flag in enumerate(flags):
        if flag & ~1:
            _fail(f"layer flag of layer {layer} is {flag}; only bit 0 may be set")
    if not any(flag & 1 for flag in flags):
        _fail("layer flags: no layer has agents")


def _check_pos_feature(index: int, kind: int, a: float) -> None:
    name = f"position feature {index}"
    if not isinstance(kind, (int, np.integer)) or not 0 <= kind < len(POS_FEATURE_KINDS):
        _fail(f"{name}: kind={kind!r} is outside 0..{len(POS_FEATURE_KINDS) - 1}")
    if not math.isfinite(a):
        _fail(f"{name}: a is not finite")
    if a == 0.0 and kind <= 1:
        _fail(f"{name}: a is zero for a linear or log feature")


def _check_recency_knots(version: int, n_knots: int, reserved: int) -> None:
    if version == 1:
        if n_knots != 0 or reserved != 0:
            _fail("reserved header bytes are not zero")
        return
    if not 1 <= n_knots <= MAX_RECENCY_KNOTS:
        _fail(f"n_recency_knots={n_knots} is outside 1..{MAX_RECENCY_KNOTS}")
    if reserved != 0:
        _fail("reserved header bytes are not zero")


def _check_finite(values: np.ndarray, layer: int, head: int, what: str) -> None:
    finite = np.isfinite(values.reshape(-1))
    if not finite.all():
        index = int(np.argmin(finite))
        _fail(f"agent (layer {layer}, head {head}): {what}[{index}] is not finite")


def _check_metadata(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        _fail(f"metadata is not valid UTF-8 (byte offset {e.start})")
    stripped = text.strip(_JSON_WHITESPACE)
    if len(stripped) < 2 or stripped[0] != "{" or stripped[-1] != "}":
        _fail("metadata is not a JSON object")
    try:
        return json.loads(text)  # a valid JSON text between braces is an object
    except ValueError as e:
        _fail(f"metadata is not valid JSON: {e}")


def _dense_shapes(input_dim: int, hidden: Sequence[int]) -> list:
    """(n_out, n_in) of each dense layer."""
    widths = [input_dim, *hidden, 1]
    return [(widths[j + 1], widths[j]) for j in range(len(widths) - 1)]


def _section_bytes(n_pos_features: int, n_layer: int, metadata_bytes: int) -> int:
    """Bytes of everything but the agents and their recency terms."""
    return HEADER_BYTES + POS_FEATURE_BYTES * n_pos_features + 4 * n_layer + metadata_bytes + CHECKSUM_BYTES


def _agent_bytes(input_dim: int, hidden: Sequence[int], value_bytes: int) -> int:
    return 2 * 4 * input_dim + sum((o * i + o) * value_bytes for o, i in _dense_shapes(input_dim, hidden))


def _f32(value: float) -> float:
    """The value as it is stored (f32), back as a Python float."""
    with np.errstate(over="ignore"):
        return float(np.float32(value))


# --- writer ---------------------------------------------------------------------------------------------------------


def encode_policy(data: PolicyData) -> bytes:
    """Serialises `data`, raising PolicyFormatError for anything the format cannot hold."""
    if data.activation not in ACTIVATIONS:
        _fail(f"activation={data.activation!r} is not one of {ACTIVATIONS}")
    if data.weight_dtype not in WEIGHT_DTYPES:
        _fail(f"weight_dtype={data.weight_dtype!r} is not one of {WEIGHT_DTYPES}")
    if not isinstance(data.arch, str):
        _fail(f"arch={data.arch!r} is not a string")
    arch = data.arch.encode("utf-8", errors="surrogatepass")
    if len(arch) >= _ARCH_BYTES:
        _fail(f"arch has no NUL terminator within its {_ARCH_BYTES} bytes ({len(arch)} bytes long)")
    arch_field = arch.ljust(_ARCH_BYTES, b"\0")
    _check_arch_bytes(arch_field)
    hidden = list(data.hidden)
    n_dense = len(hidden) + 1
    fields = {
        **{name: value for name, value in data.identity().items() if name != "arch"},
        "n_pos_features": len(data.pos_features),
        "n_dense": n_dense,
        "activation": ACTIVATIONS.index(data.activation),
        "weight_dtype": WEIGHT_DTYPES.index(data.weight_dtype),
        "n_sink": data.n_sink,
        "n_recent": data.n_recent,
    }
    _check_ranged_fields(fields)
    _check_hidden(n_dense, hidden + [0] * (MAX_DENSE - n_dense))
    try:
        metadata = json.dumps(data.metadata, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as e:
        _fail(f"metadata cannot be written as JSON: {e}")
    _check_metadata(metadata)
    _check_metadata_bytes(len(metadata))

    if len(data.layer_scored) != data.n_layer:
        _fail(f"layer_scored has {len(data.layer_scored)} entries but n_layer={data.n_layer}")
    flags = [1 if scored else 0 for scored in data.layer_scored]
    _check_layer_flags(flags)

    parts = [b""]  # header placeholder
    for index, (kind, a) in enumerate(data.pos_features):
        a32 = _f32(a)
        _check_pos_feature(index, kind, a32)
        parts.append(struct.pack("<If", kind, a32))
    parts.append(struct.pack(f"<{len(flags)}I", *flags))

    expected_keys = {(layer, head) for layer in range(data.n_layer) if flags[layer] for head in range(data.n_head_kv)}
    if set(data.agents) != expected_keys:
        missing = sorted(expected_keys - set(data.agents))[:4]
        extra = sorted(set(data.agents) - expected_keys)[:4]
        _fail(f"agents do not match layer_scored x n_head_kv (missing {missing}, unexpected {extra})")
    value_dtype = _NUMPY_DTYPES[data.weight_dtype]
    shapes = _dense_shapes(data.input_dim, hidden)
    for layer, head in sorted(expected_keys):
        agent = data.agents[layer, head]
        where = f"agent (layer {layer}, head {head})"
        for what, values in (("shift", agent.shift), ("scale", agent.scale)):
            values = _as_stored(values, np.dtype("<f4"), (data.input_dim,), f"{where}: {what}")
            _check_finite(values, layer, head, what)
            parts.append(values.tobytes())
        if len(agent.weights) != n_dense or len(agent.biases) != n_dense:
            _fail(f"{where}: has {len(agent.weights)} weights and {len(agent.biases)} biases, n_dense={n_dense}")
        for j, (n_out, n_in) in enumerate(shapes):
            for what, values, shape in (("weight", agent.weights[j], (n_out, n_in)), ("bias", agent.biases[j], (n_out,))):
                values = _as_stored(values, value_dtype, shape, f"{where}: dense {j} {what}")
                _check_finite(values, layer, head, f"dense {j} {what}")
                parts.append(values.tobytes())
    n_knots = data.n_recency_knots
    if data.recency:
        if set(data.recency) != expected_keys:
            _fail("recency terms do not match layer_scored x n_head_kv: every scored agent has one, or none does")
        _check_recency_knots(2, n_knots, 0)
        for layer, head in sorted(expected_keys):
            values = _as_stored(data.recency[layer, head], np.dtype("<f4"), (n_knots,),
                                f"agent (layer {layer}, head {head}): recency")
            _check_finite(values, layer, head, "recency")
            parts.append(values.tobytes())
    parts.append(metadata)

    body_bytes = sum(len(p) for p in parts) + HEADER_BYTES
    header = dict(
        magic=MAGIC, version=2 if n_knots else 1, header_bytes=HEADER_BYTES, file_bytes=body_bytes + CHECKSUM_BYTES,
        arch=arch_field, hidden0=0, hidden1=0, hidden2=0, metadata_bytes=len(metadata), n_recency_knots=n_knots,
        reserved=0, **fields,
    )  # fmt: skip
    for j, width in enumerate(hidden):
        header[f"hidden{j}"] = width
    parts[0] = _HEADER.pack(*(header[name] for name in _HEADER_NAMES))
    body = b"".join(parts)
    return body + struct.pack("<I", zlib.crc32(body))


def _as_stored(values, dtype: np.dtype, shape: tuple, what: str) -> np.ndarray:
    array = np.asarray(values)
    if array.shape != shape:
        _fail(f"{what} has shape {array.shape}, expected {shape}")
    with np.errstate(over="ignore", invalid="ignore"):
        return np.ascontiguousarray(array, dtype=dtype)


def write_policy(path, data: PolicyData) -> None:
    blob = encode_policy(data)
    with open(path, "wb") as f:
        f.write(blob)


# --- reader ---------------------------------------------------------------------------------------------------------


def decode_policy(blob: bytes) -> PolicyData:
    """Parses a complete file image with the same checks, in the same order, as the C++ loader."""
    blob = bytes(blob)
    size = len(blob)
    if size < HEADER_BYTES:
        _fail(f"file is {size} bytes, shorter than the {HEADER_BYTES}-byte header")
    h = dict(zip(_HEADER_NAMES, _HEADER.unpack_from(blob)))
    if h["magic"] != MAGIC:
        _fail("bad magic: not a kvp.bin policy file")
    if h["version"] not in SUPPORTED_VERSIONS:
        _fail(f"version={h['version']} is not supported (expected 1 or 2)")
    if h["header_bytes"] != HEADER_BYTES:
        _fail(f"header_bytes={h['header_bytes']} (expected {HEADER_BYTES})")
    if h["file_bytes"] != size:
        _fail(f"file_bytes={h['file_bytes']} but the file is {size} bytes")
    if size < HEADER_BYTES + CHECKSUM_BYTES:
        _fail(f"file is {size} bytes, too short to hold the checksum after the header")
    body_bytes = size - CHECKSUM_BYTES
    (stored_crc,) = struct.unpack_from("<I", blob, body_bytes)
    computed_crc = zlib.crc32(memoryview(blob)[:body_bytes])
    if stored_crc != computed_crc:
        _fail(f"checksum mismatch: stored {stored_crc:#x}, computed {computed_crc:#x}")

    arch = _check_arch_bytes(h["arch"])
    _check_ranged_fields(h)
    n_dense = h["n_dense"]
    _check_hidden(n_dense, [h["hidden0"], h["hidden1"], h["hidden2"]])
    hidden = [h[f"hidden{j}"] for j in range(n_dense - 1)]
    _check_metadata_bytes(h["metadata_bytes"])
    _check_recency_knots(h["version"], h["n_recency_knots"], h["reserved"])
    n_knots = h["n_recency_knots"]

    n_layer, n_head_kv, n_pos = h["n_layer"], h["n_head_kv"], h["n_pos_features"]
    fixed_bytes = _section_bytes(n_pos, n_layer, h["metadata_bytes"])
    if fixed_bytes > size:
        _fail(
            f"file_bytes={size} is less than the {fixed_bytes} bytes the header, position features, layer flags, "
            "metadata and checksum need"
        )
    flags_offset = HEADER_BYTES + POS_FEATURE_BYTES * n_pos
    flags = struct.unpack_from(f"<{n_layer}I", blob, flags_offset)
    _check_layer_flags(flags)
    n_scored = sum(flag & 1 for flag in flags)
    input_dim = h["head_dim_k"] + h["head_dim_v"] + n_pos
    weight_dtype = WEIGHT_DTYPES[h["weight_dtype"]]
    value_dtype = _NUMPY_DTYPES[weight_dtype]
    total_bytes = fixed_bytes + n_scored * n_head_kv * (_agent_bytes(input_dim, hidden, value_dtype.itemsize) + 4 * n_knots)
    if total_bytes != size:
        _fail(f"file_bytes={size} but the sections require {total_bytes} bytes")

    features = []
    for index in range(n_pos):
        kind, a = struct.unpack_from("<If", blob, HEADER_BYTES + POS_FEATURE_BYTES * index)
        _check_pos_feature(index, kind, a)
        features.append((kind, a))

    offset = flags_offset + 4 * n_layer

    def take(dtype: np.dtype, count: int, layer: int, head: int, what: str) -> np.ndarray:
        nonlocal offset
        values = np.frombuffer(blob, dtype=dtype, count=count, offset=offset).copy()
        offset += count * dtype.itemsize
        _check_finite(values, layer, head, what)
        return values

    shapes = _dense_shapes(input_dim, hidden)
    agents = {}
    for layer in range(n_layer):
        if not flags[layer] & 1:
            continue
        for head in range(n_head_kv):
            shift = take(np.dtype("<f4"), input_dim, layer, head, "shift")
            scale = take(np.dtype("<f4"), input_dim, layer, head, "scale")
            weights, biases = [], []
            for j, (n_out, n_in) in enumerate(shapes):
                weights.append(take(value_dtype, n_out * n_in, layer, head, f"dense {j} weight").reshape(n_out, n_in))
                biases.append(take(value_dtype, n_out, layer, head, f"dense {j} bias"))
            agents[layer, head] = Agent(shift=shift, scale=scale, weights=weights, biases=biases)
    recency = {key: take(np.dtype("<f4"), n_knots, *key, "recency") for key in agents} if n_knots else {}

    metadata = _check_metadata(blob[offset:body_bytes])
    return PolicyData(
        arch=arch,
        n_layer=n_layer,
        n_head_kv=n_head_kv,
        head_dim_k=h["head_dim_k"],
        head_dim_v=h["head_dim_v"],
        n_ctx_train=h["n_ctx_train"],
        pos_features=features,
        hidden=hidden,
        activation=ACTIVATIONS[h["activation"]],
        weight_dtype=weight_dtype,
        n_sink=h["n_sink"],
        n_recent=h["n_recent"],
        layer_scored=[bool(flag & 1) for flag in flags],
        agents=agents,
        metadata=metadata,
        recency=recency,
    )


def read_policy(path) -> PolicyData:
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                _fail(f"policy file '{path}' is not a regular file")
            if st.st_size > MAX_FILE_BYTES:
                _fail(f"policy file '{path}' is {st.st_size} bytes, more than the 2 GiB limit")
            blob = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise PolicyFormatError(f"cannot read policy file '{path}': {e.strerror or e}") from e
    try:
        return decode_policy(blob)
    except PolicyFormatError as e:
        raise PolicyFormatError(f"policy file '{path}': {e}") from None


# --- position features, reference scorer, test policies ------------------------------------------------------------


def default_pos_features(n_ctx_train: int) -> list:
    """A log and a linear feature, both within about [0, 1] inside the training context."""
    return [(1, _f32(math.log1p(n_ctx_train))), (0, _f32(n_ctx_train))]


def pos_features(features, positions: np.ndarray) -> np.ndarray:
    """(T, P) float32 feature values: the same formulas as the C++ loader, in float64, rounded to float32."""
    p = np.asarray(positions, dtype=np.int64).astype(np.float64).reshape(-1)
    out = np.empty((p.shape[0], len(features)), dtype=np.float32)
    with np.errstate(all="ignore"):
        for i, (kind, a) in enumerate(features):
            a = np.float64(_f32(a))
            if kind == 0:
                value = p / a
            elif kind == 1:
                value = np.log(1.0 + p) / a
            elif kind == 2:
                value = np.sin(p * a)
            elif kind == 3:
                value = np.cos(p * a)
            else:
                raise PolicyFormatError(f"position feature {i}: kind={kind!r} is outside 0..3")
            out[:, i] = value
    return out


def _activate(name: str, x: np.ndarray) -> np.ndarray:
    if name == "relu":
        return np.maximum(x, 0.0)
    if name == "silu":
        return x / (1.0 + np.exp(-x))
    if name == "gelu_tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    if name == "tanh":
        return np.tanh(x)
    raise ValueError(f"unknown activation {name!r}")


def reference_scores(data: PolicyData, layer: int, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """float64 scores (T, H) of one layer for keys k (T, H, dk), values v (T, H, dv) at original positions (T,)."""
    if not 0 <= layer < data.n_layer or not data.layer_scored[layer]:
        raise ValueError(f"layer {layer} has no agents")
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    n_tokens = k.shape[0]
    if k.shape != (n_tokens, data.n_head_kv, data.head_dim_k) or v.shape != (n_tokens, data.n_head_kv, data.head_dim_v):
        raise ValueError(f"k {k.shape} / v {v.shape} do not match n_head_kv and the head dims of the policy")
    features = pos_features(data.pos_features, positions).astype(np.float64)
    if features.shape[0] != n_tokens:
        raise ValueError(f"{features.shape[0]} positions for {n_tokens} tokens")
    scores = np.empty((n_tokens, data.n_head_kv), dtype=np.float64)
    with np.errstate(over="ignore"):
        for head in range(data.n_head_kv):
            agent = data.agents[layer, head]
            x = np.concatenate([k[:, head], v[:, head], features], axis=1)
            x = (x - agent.shift.astype(np.float64)) * agent.scale.astype(np.float64)
            last = len(agent.weights) - 1
            for j, (w, b) in enumerate(zip(agent.weights, agent.biases)):
                x = x @ np.asarray(w, dtype=np.float64).T + np.asarray(b, dtype=np.float64)
                if j < last:
                    x = _activate(data.activation, x)
            scores[:, head] = x[:, 0]
    return scores


def recency_terms(data: PolicyData, layer: int, ages: np.ndarray) -> np.ndarray:
    """float64 recency terms (T, H) of one layer for token ages (T,) ≥ 1; zeros for a policy without them.

    A token's age is the next position to be written minus its original position, so the newest cached token has
    age 1. With K knots h_0 … h_(K−1) at ages 2^0 … 2^(K−1), u = clamp(log2(age), 0, K−1), j = min(floor(u), K−2),
    t = u − j: the term is (1 − t)·h_j + t·h_(j+1), linear in log2(age) between knots and constant beyond the last
    (h_0 when K = 1). The evictor ranks by the agent's MLP score plus this term.
    """
    if not 0 <= layer < data.n_layer or not data.layer_scored[layer]:
        raise ValueError(f"layer {layer} has no agents")
    ages = np.asarray(ages, dtype=np.int64).reshape(-1)
    if (ages < 1).any():
        raise ValueError("token ages must be at least 1")
    out = np.zeros((ages.shape[0], data.n_head_kv), dtype=np.float64)
    knots = data.n_recency_knots
    if not knots:
        return out
    u = np.minimum(np.log2(ages.astype(np.float64)), knots - 1)
    j = np.minimum(np.floor(u), max(knots - 2, 0)).astype(np.int64)
    t = u - j
    upper = np.minimum(j + 1, knots - 1)
    for head in range(data.n_head_kv):
        h = np.asarray(data.recency[layer, head], dtype=np.float64)
        out[:, head] = (1.0 - t) * h[j] + t * h[upper]
    return out


def smollm2_identity() -> dict:
    """SmolLM2-135M: llama, 30 layers, 3 KV heads of 64, 8192 training context."""
    return {"arch": "llama", "n_layer": 30, "n_head_kv": 3, "head_dim_k": 64, "head_dim_v": 64, "n_ctx_train": 8192}


def random_policy(
    *,
    arch: str = "llama",
    n_layer: int = 30,
    n_head_kv: int = 3,
    head_dim_k: int = 64,
    head_dim_v: int = 64,
    n_ctx_train: int = 8192,
    hidden: Sequence[int] = (32,),
    activation: str = "relu",
    weight_dtype: str = "f32",
    seed: int = 0,
    layer_scored: Optional[Sequence[bool]] = None,
    pos: Optional[Sequence[tuple]] = None,
    metadata: Optional[dict] = None,
) -> PolicyData:
    """A valid policy with He-initialised weights and random-ish normalisation, for tests and benchmarks."""
    rng = np.random.default_rng(seed)
    features = default_pos_features(n_ctx_train) if pos is None else [(int(kind), _f32(a)) for kind, a in pos]
    scored = [True] * n_layer if layer_scored is None else [bool(s) for s in layer_scored]
    data = PolicyData(
        arch=arch,
        n_layer=n_layer,
        n_head_kv=n_head_kv,
        head_dim_k=head_dim_k,
        head_dim_v=head_dim_v,
        n_ctx_train=n_ctx_train,
        pos_features=features,
        hidden=list(hidden),
        activation=activation,
        weight_dtype=weight_dtype,
        layer_scored=scored,
        metadata={"generator": "random_policy", "seed": seed} if metadata is None else metadata,
    )
    if weight_dtype not in WEIGHT_DTYPES:
        _fail(f"weight_dtype={weight_dtype!r} is not one of {WEIGHT_DTYPES}")
    value_dtype = _NUMPY_DTYPES[weight_dtype]
    dim = data.input_dim
    for layer in range(n_layer):
        if not scored[layer]:
            continue
        for head in range(n_head_kv):
            weights, biases = [], []
            for n_out, n_in in _dense_shapes(dim, data.hidden):
                weights.append((rng.standard_normal((n_out, n_in)) * math.sqrt(2.0 / n_in)).astype(value_dtype))
                biases.append((rng.standard_normal(n_out) * 0.1).astype(value_dtype))
            data.agents[layer, head] = Agent(
                shift=(rng.standard_normal(dim) * 0.5).astype(np.float32),
                scale=rng.uniform(0.5, 2.0, dim).astype(np.float32),
                weights=weights,
                biases=biases,
            )
    return data
