"""kvp.bin format: the Python reader/writer (kvp_cpp.policy_file) and the C++ loader (kvp_cpp._core) against the
spec in docs/kvp-bin-format.md and against each other."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import struct
import zlib

import numpy as np
import pytest

from kvp_cpp import _core
from kvp_cpp.policy_file import (
    Agent,
    PolicyData,
    PolicyFormatError,
    decode_policy,
    default_pos_features,
    encode_policy,
    pos_features,
    random_policy,
    read_policy,
    recency_terms,
    reference_scores,
    smollm2_identity,
    write_policy,
)

# Header offsets, straight from the spec's layout table.
U32_FIELDS = {
    "version": 8, "header_bytes": 12, "n_layer": 56, "n_head_kv": 60, "head_dim_k": 64, "head_dim_v": 68,
    "n_ctx_train": 72, "n_pos_features": 76, "n_dense": 80, "hidden[0]": 84, "hidden[1]": 88, "hidden[2]": 92,
    "activation": 96, "weight_dtype": 100, "n_sink": 104, "n_recent": 108, "n_recency_knots": 120,
    "reserved[124]": 124,
}  # fmt: skip
U64_FIELDS = {"file_bytes": 16, "metadata_bytes": 112, "reserved": 120}  # version 1: 120..127 reserved
ARCH_OFFSET = 24
HEADER = 128

ERRORS = (PolicyFormatError, _core.PolicyFormatError)


# --- helpers ----------------------------------------------------------------------------------------------------------


def small_policy(weight_dtype: str = "f32", **overrides) -> PolicyData:
    """2 layers (only layer 0 scored) x 2 heads, D = 3 + 2 + 2, hidden (4,): a file of a few hundred bytes."""
    args = dict(
        arch="tiny", n_layer=2, n_head_kv=2, head_dim_k=3, head_dim_v=2, n_ctx_train=64, hidden=(4,),
        weight_dtype=weight_dtype, layer_scored=[True, False], metadata={"note": "small"}, seed=7,
    )  # fmt: skip
    args.update(overrides)
    return random_policy(**args)


def with_recency(data: PolicyData, knots: int = 3, seed: int = 5) -> PolicyData:
    """data with a recency term of `knots` values for every scored agent (a version 2 file)."""
    rng = np.random.default_rng(seed)
    data.recency = {key: rng.standard_normal(knots).astype(np.float32) for key in sorted(data.agents)}
    return data


def refresh(blob) -> bytes:
    """Re-stamps file_bytes and the CRC so that only the intended defect remains."""
    out = bytearray(blob)
    struct.pack_into("<Q", out, U64_FIELDS["file_bytes"], len(out))
    struct.pack_into("<I", out, len(out) - 4, zlib.crc32(bytes(out[:-4])))
    return bytes(out)


def put(blob, offset: int, fmt: str, *values, fix_crc: bool = True) -> bytes:
    out = bytearray(blob)
    struct.pack_into(fmt, out, offset, *values)
    return refresh(out) if fix_crc else bytes(out)


def put_field(blob, name: str, value, fix_crc: bool = True) -> bytes:
    if name in U32_FIELDS:
        return put(blob, U32_FIELDS[name], "<I", value, fix_crc=fix_crc)
    return put(blob, U64_FIELDS[name], "<Q", value, fix_crc=fix_crc)


def with_metadata(blob: bytes, raw: bytes) -> bytes:
    (old,) = struct.unpack_from("<Q", blob, U64_FIELDS["metadata_bytes"])
    start = len(blob) - 4 - old
    out = bytearray(blob[:start] + raw + b"\0\0\0\0")
    struct.pack_into("<Q", out, U64_FIELDS["metadata_bytes"], len(raw))
    return refresh(out)


def value_offsets(data: PolicyData) -> dict:
    """File offset of every agent array, keyed (layer, head, what) with what = 'shift', 'dense 1 bias', ..."""
    offset = HEADER + 8 * len(data.pos_features) + 4 * data.n_layer
    width = 2 if data.weight_dtype == "f16" else 4
    offsets = {}
    for layer in range(data.n_layer):
        if not data.layer_scored[layer]:
            continue
        for head in range(data.n_head_kv):
            agent = data.agents[layer, head]
            for what in ("shift", "scale"):
                offsets[layer, head, what] = offset
                offset += 4 * data.input_dim
            for j, (w, b) in enumerate(zip(agent.weights, agent.biases)):
                offsets[layer, head, f"dense {j} weight"] = offset
                offset += width * w.size
                offsets[layer, head, f"dense {j} bias"] = offset
                offset += width * b.size
    return offsets


def assert_same_data(a: PolicyData, b: PolicyData) -> None:
    for f in dataclasses.fields(PolicyData):
        if f.name not in ("agents", "recency"):
            assert getattr(a, f.name) == getattr(b, f.name), f.name
    assert a.recency.keys() == b.recency.keys()
    for key, values in a.recency.items():
        assert values.dtype == np.float32
        np.testing.assert_array_equal(values, b.recency[key])
    assert a.agents.keys() == b.agents.keys()
    for key, agent in a.agents.items():
        other = b.agents[key]
        for name in ("shift", "scale"):
            assert getattr(agent, name).dtype == np.float32
            np.testing.assert_array_equal(getattr(agent, name), getattr(other, name))
        assert len(agent.weights) == len(other.weights) and len(agent.biases) == len(other.biases)
        for x, y in zip(agent.weights + agent.biases, other.weights + other.biases):
            assert x.dtype == y.dtype and x.shape == y.shape
            np.testing.assert_array_equal(x, y)


def assert_core_matches(policy, data: PolicyData) -> None:
    """The C++ Policy holds exactly what the Python PolicyData holds (weights widened to f32)."""
    assert policy.identity == data.identity()
    assert (policy.n_sink, policy.n_recent) == (data.n_sink, data.n_recent)
    assert list(policy.hidden) == list(data.hidden)
    assert (policy.activation, policy.weight_dtype) == (data.activation, data.weight_dtype)
    assert [tuple(f) for f in policy.pos_features] == [tuple(f) for f in data.pos_features]
    assert list(policy.layer_scored) == list(data.layer_scored)
    assert policy.input_dim == data.input_dim
    assert json.loads(policy.metadata_json) == data.metadata
    assert policy.n_recency_knots == data.n_recency_knots
    for (layer, head), agent in data.agents.items():
        native = policy.agent(layer, head)
        np.testing.assert_array_equal(native["recency"], data.recency.get((layer, head), np.zeros(0, np.float32)))
        np.testing.assert_array_equal(native["shift"], agent.shift)
        np.testing.assert_array_equal(native["scale"], agent.scale)
        assert len(native["weights"]) == len(agent.weights) and len(native["biases"]) == len(agent.biases)
        for x, y in zip(native["weights"] + native["biases"], agent.weights + agent.biases):
            assert x.dtype == np.float32 and x.shape == y.shape
            np.testing.assert_array_equal(x, y.astype(np.float32))


def both_reject(blob: bytes) -> tuple[str, str]:
    """Both readers refuse `blob`; returns (Python message, C++ message)."""
    with pytest.raises(PolicyFormatError) as py:
        decode_policy(blob)
    with pytest.raises(_core.PolicyFormatError) as cc:
        _core.parse_policy(blob)
    return str(py.value), str(cc.value)


@pytest.fixture(scope="module")
def small_blob() -> bytes:
    return encode_policy(small_policy())


# --- round trips ------------------------------------------------------------------------------------------------------

SHAPES = {
    "smollm2": dict(),
    "no-hidden": dict(n_layer=3, hidden=()),
    "two-hidden-silu": dict(n_layer=4, n_head_kv=2, hidden=(16, 8), activation="silu"),
    "three-hidden-gelu": dict(n_layer=2, n_head_kv=1, head_dim_k=8, head_dim_v=4, hidden=(5, 6, 7), activation="gelu_tanh"),
    "unscored-layers-tanh": dict(arch="gemma3", n_layer=6, n_head_kv=1, head_dim_k=16, head_dim_v=16, activation="tanh",
                                 layer_scored=[False, True, False, False, True, False]),
    "no-pos-features": dict(n_layer=2, pos=[]),
    "all-pos-kinds": dict(n_layer=1, n_head_kv=4, pos=[(0, 100.0), (1, 9.0), (2, 0.01), (3, 0.001), (2, 0.0)],
                          metadata={"emoji": "\u00e9\u6f22\U0001f600", "nested": {"list": [1, 2.5, None]}}),
}  # fmt: skip


@pytest.mark.parametrize("weight_dtype", ["f32", "f16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_round_trip_python_and_cpp(shape, weight_dtype, tmp_path):
    data = random_policy(weight_dtype=weight_dtype, seed=len(shape), **SHAPES[shape])
    blob = encode_policy(data)
    decoded = decode_policy(blob)
    assert_same_data(decoded, data)
    assert encode_policy(decoded) == blob
    expected_dtype = np.float16 if weight_dtype == "f16" else np.float32
    assert all(w.dtype == expected_dtype for agent in decoded.agents.values() for w in agent.weights + agent.biases)

    assert_core_matches(_core.parse_policy(blob), data)
    path = tmp_path / "policy.kvp.bin"
    write_policy(path, data)
    assert path.read_bytes() == blob
    assert_same_data(read_policy(path), data)
    assert_core_matches(_core.load_policy(str(path)), data)


def test_file_size_matches_layout():
    data = small_policy()
    blob = encode_policy(data)
    metadata = json.dumps(data.metadata, ensure_ascii=False).encode()
    agent = 4 * 2 * 7 + 4 * (4 * 7 + 4) + 4 * (1 * 4 + 1)
    assert len(blob) == HEADER + 8 * 2 + 4 * 2 + 2 * agent + len(metadata) + 4
    assert blob[:8] == b"KVPOLICY"
    assert blob[-4 - len(metadata) : -4] == metadata
    assert struct.unpack_from("<I", blob, len(blob) - 4)[0] == zlib.crc32(blob[:-4])


# --- version 2: recency terms -----------------------------------------------------------------------------------

SHIPPED = sorted((pathlib.Path(__file__).resolve().parents[1] / "models").glob("*.kvp.bin"))


@pytest.mark.parametrize("knots", [1, 3, 32])
@pytest.mark.parametrize("weight_dtype", ["f32", "f16"])
def test_recency_round_trip_python_and_cpp(knots, weight_dtype, tmp_path):
    plain = encode_policy(small_policy(weight_dtype))
    data = with_recency(small_policy(weight_dtype), knots)
    blob = encode_policy(data)
    assert struct.unpack_from("<II", blob, 8)[0] == 2 and struct.unpack_from("<I", blob, 120)[0] == knots
    assert len(blob) == len(plain) + 4 * knots * 2  # two scored agents, f32 values after the agents
    assert blob[-4 - len(json.dumps(data.metadata)) - 8 * knots : -4 - len(json.dumps(data.metadata))] == b"".join(
        data.recency[key].tobytes() for key in sorted(data.agents)
    )
    decoded = decode_policy(blob)
    assert_same_data(decoded, data)
    assert encode_policy(decoded) == blob
    assert_core_matches(_core.parse_policy(blob), data)
    path = tmp_path / "policy.kvp.bin"
    write_policy(path, data)
    assert_core_matches(_core.load_policy(str(path)), data)


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_policies_without_recency_stay_version_1_byte_for_byte(path):
    blob = path.read_bytes()
    data = decode_policy(blob)
    if data.recency:
        pytest.skip("this shipped policy has recency terms")
    assert struct.unpack_from("<I", blob, 8)[0] == 1
    assert encode_policy(data) == blob


def test_recency_terms_by_hand():
    data = small_policy()
    data.recency = {(0, 0): np.array([2.0, -1.0, 4.0], np.float32), (0, 1): np.array([0.5, 0.5, 0.5], np.float32)}
    ages = np.array([1, 2, 3, 4, 5, 8, 1 << 40], np.int64)
    u3 = math.log2(3)  # between the knots at ages 2 and 4
    expected = [2.0, -1.0, -1.0 + (u3 - 1) * 5.0, 4.0, 4.0, 4.0, 4.0]  # constant from the last knot (age 4) on
    np.testing.assert_allclose(recency_terms(data, 0, ages)[:, 0], expected, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(recency_terms(data, 0, ages)[:, 1], 0.5)
    native = _core.recency_terms(_core.parse_policy(encode_policy(data)), 0, ages)
    np.testing.assert_allclose(native, recency_terms(data, 0, ages), rtol=0, atol=1e-12)
    single = small_policy()
    single.recency = {(0, 0): np.array([3.0], np.float32), (0, 1): np.array([-2.0], np.float32)}
    np.testing.assert_array_equal(_core.recency_terms(_core.parse_policy(encode_policy(single)), 0, ages),
                                  np.tile([3.0, -2.0], (len(ages), 1)))
    np.testing.assert_array_equal(recency_terms(small_policy(), 0, ages), 0.0)  # none: zeros
    for reader in (lambda a: recency_terms(data, 0, a),
                   lambda a: _core.recency_terms(_core.parse_policy(encode_policy(data)), 0, a)):
        with pytest.raises(ValueError, match="at least 1"):
            reader(np.array([3, 0], np.int64))
    with pytest.raises(ValueError, match="no agents"):
        recency_terms(data, 1, ages)


def _recency_offset(blob: bytes, data: PolicyData) -> int:
    return len(blob) - 4 - len(json.dumps(data.metadata).encode()) - 4 * data.n_recency_knots * len(data.agents)


MALFORMED_V2 = [
    ("knots-over", lambda b, o: put_field(b, "n_recency_knots", 33), "n_recency_knots=33 is outside 1..32"),
    ("knots-fewer", lambda b, o: put_field(b, "n_recency_knots", 2), "sections require"),
    ("reserved", lambda b, o: put_field(b, "reserved[124]", 7), "reserved header bytes are not zero"),
    ("as-version-1", lambda b, o: put_field(b, "version", 1), "reserved header bytes are not zero"),
    ("recency-nan", lambda b, o: put(b, o + 4 * 5, "<f", float("nan")), "agent (layer 0, head 1): recency[2] is not finite"),
    ("recency-inf", lambda b, o: put(b, o, "<f", float("-inf")), "agent (layer 0, head 0): recency[0] is not finite"),
]  # fmt: skip


@pytest.mark.parametrize("mutate, expected", [m[1:] for m in MALFORMED_V2], ids=[m[0] for m in MALFORMED_V2])
def test_malformed_recency_rejected_by_both_readers(mutate, expected):
    data = with_recency(small_policy())
    blob = encode_policy(data)
    py_message, cpp_message = both_reject(mutate(blob, _recency_offset(blob, data)))
    assert expected in py_message
    assert py_message == cpp_message


def test_truncated_version_2_file_is_a_clean_error():
    blob = encode_policy(with_recency(small_policy()))
    for size in range(len(blob)):
        py_message, cpp_message = both_reject(blob[:size])
        assert ("128-byte header" if size < HEADER else "file_bytes") in py_message
        assert py_message == cpp_message


INVALID_RECENCY = [
    ("some-agents", lambda d: {(0, 0): np.zeros(3, np.float32)}, "recency terms do not match"),
    ("lengths-differ", lambda d: {(0, 0): np.zeros(3, np.float32), (0, 1): np.zeros(2, np.float32)}, "has shape (2,)"),
    ("too-many-knots", lambda d: {key: np.zeros(33, np.float32) for key in d.agents}, "n_recency_knots=33"),
    ("nan", lambda d: {(0, 0): np.zeros(3), (0, 1): np.array([0.0, np.nan, 0.0])}, "(layer 0, head 1): recency[1]"),
]  # fmt: skip


@pytest.mark.parametrize("recency, expected", [m[1:] for m in INVALID_RECENCY], ids=[m[0] for m in INVALID_RECENCY])
def test_encode_rejects_invalid_recency(recency, expected):
    data = small_policy()
    data.recency = recency(data)
    with pytest.raises(PolicyFormatError) as e:
        encode_policy(data)
    assert expected in str(e.value)


def test_f16_widening_is_exact_for_special_values():
    data = small_policy("f16")
    patterns = np.array(
        [0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0200, 0x0400, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF, 0x3555, 0x0155],
        dtype=np.uint16,
    )
    weights = data.agents[0, 1].weights[0]  # 4 x 7
    weights.reshape(-1).view(np.uint16)[: patterns.size] = patterns
    policy = _core.parse_policy(encode_policy(data))
    native = policy.agent(0, 1)["weights"][0].reshape(-1)[: patterns.size]
    expected = patterns.view(np.float16).astype(np.float32)
    assert native.view(np.uint32).tolist() == expected.view(np.uint32).tolist()  # also tells -0 from +0
    assert native[2] == 2.0**-24 and native[9] == 65504.0


def test_default_pos_features_span_the_training_context():
    features = default_pos_features(8192)
    assert [kind for kind, _ in features] == [1, 0]
    values = pos_features(features, np.array([0, 8191]))
    assert values[0].tolist() == [0.0, 0.0]
    assert 0.99 < values[1, 0] <= 1.0 and 0.99 < values[1, 1] <= 1.0


def test_pos_features_match_cpp():
    data = random_policy(
        n_layer=1, n_head_kv=1, head_dim_k=2, head_dim_v=2,
        pos=[(0, 8192.0), (1, math.log1p(8192)), (2, 0.0123), (3, 1e-4), (0, -3.0), (2, 0.0), (3, 7.5)],
    )  # fmt: skip
    policy = _core.parse_policy(encode_policy(data))
    positions = np.array([0, 1, 2, 17, 255, 4095, 8191, 8192, 100_000, 123_456_789, 2**40], dtype=np.int64)
    expected = pos_features(data.pos_features, positions)
    native = _core.pos_features(policy, positions)
    assert native.dtype == np.float32 and native.shape == expected.shape
    np.testing.assert_array_equal(native[:, [0, 4, 5]], expected[:, [0, 4, 5]])  # p / a and sin(0): exact
    np.testing.assert_array_max_ulp(native, expected, maxulp=1)  # libm vs numpy log/sin/cos
    assert expected[6, 0] == np.float32(8191 / 8192) and expected[0].tolist()[:2] == [0.0, 0.0]


def test_crc_matches_zlib():
    rng = np.random.default_rng(1)
    assert _core.crc32(b"123456789") == zlib.crc32(b"123456789") == 0xCBF43926
    for size in (0, 1, 3, 4, 7, 64, 1000, 4099):
        blob = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        assert _core.crc32(blob) == zlib.crc32(blob)


# --- identity -----------------------------------------------------------------------------------------------------


def test_check_identity_accepts_the_same_model():
    data = random_policy(n_layer=30, n_head_kv=3, hidden=(4,), seed=3)
    assert data.identity() == smollm2_identity()
    _core.parse_policy(encode_policy(data)).check_identity(smollm2_identity())


@pytest.mark.parametrize(
    "field, value", [("arch", "gemma3"), ("n_layer", 26), ("n_head_kv", 1), ("head_dim_k", 128),
                     ("head_dim_v", 96), ("n_ctx_train", 32768)],
)  # fmt: skip
def test_check_identity_names_the_differing_field(field, value):
    policy = _core.parse_policy(encode_policy(random_policy(hidden=(4,), seed=3)))
    model = {**smollm2_identity(), field: value}
    with pytest.raises(_core.PolicyFormatError) as e:
        policy.check_identity(model)
    message = str(e.value)
    assert "trained for llama n_layer=30 n_head_kv=3 head_dim_k=64 head_dim_v=64 n_ctx_train=8192" in message
    assert message.endswith(f"(differing: {field})")


def test_check_identity_names_every_differing_field():
    policy = _core.parse_policy(encode_policy(random_policy(hidden=(4,), seed=3)))
    gemma = {"arch": "gemma3", "n_layer": 26, "n_head_kv": 1, "head_dim_k": 256, "head_dim_v": 256, "n_ctx_train": 8192}
    with pytest.raises(_core.PolicyFormatError) as e:
        policy.check_identity(gemma)
    assert "but the model is gemma3 n_layer=26 n_head_kv=1 head_dim_k=256" in str(e.value)
    assert str(e.value).endswith("(differing: arch, n_layer, n_head_kv, head_dim_k, head_dim_v)")


# --- reference scorer -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "activation, act",
    [
        ("relu", lambda x: max(x, 0.0)),
        ("silu", lambda x: x / (1 + math.exp(-x))),
        ("gelu_tanh", lambda x: 0.5 * x * (1 + math.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))),
        ("tanh", math.tanh),
    ],
)
def test_reference_scores_by_hand(activation, act):
    # D = 1 + 1 + 1 (a linear position feature with a = 10), one hidden unit.
    data = random_policy(n_layer=1, n_head_kv=1, head_dim_k=1, head_dim_v=1, hidden=(1,), activation=activation,
                         pos=[(0, 10.0)])  # fmt: skip
    data.agents[0, 0] = Agent(
        shift=np.array([1.0, 0.0, 0.5], np.float32),
        scale=np.array([2.0, 1.0, 4.0], np.float32),
        weights=[np.array([[1.0, -1.0, 0.25]], np.float32), np.array([[2.0]], np.float32)],
        biases=[np.array([0.5], np.float32), np.array([-1.0], np.float32)],
    )
    k = np.array([3.0, -2.0]).reshape(2, 1, 1)
    v = np.array([1.0, 4.0]).reshape(2, 1, 1)
    positions = np.array([5, 20])
    scores = reference_scores(data, 0, k, v, positions)
    for t in range(2):
        x = [(k[t, 0, 0] - 1.0) * 2.0, v[t, 0, 0] * 1.0, (positions[t] / 10.0 - 0.5) * 4.0]
        hidden = act(x[0] - x[1] + 0.25 * x[2] + 0.5)
        assert scores[t, 0] == pytest.approx(2.0 * hidden - 1.0, rel=1e-12, abs=1e-12)
    with pytest.raises(ValueError):
        reference_scores(dataclasses.replace(data, layer_scored=[False]), 0, k, v, positions)


# --- malformed files --------------------------------------------------------------------------------------------------


def set_metadata(raw: bytes):
    return lambda blob: with_metadata(blob, raw)


def set_value(what: str, layer: int, head: int, index: int, fmt: str, value):
    """Overwrites element `index` of one agent array; fmt '<H' (raw f16 bits) is for the f16 file."""
    weight_dtype = "f16" if fmt == "<H" else "f32"

    def mutate(blob):
        offset = value_offsets(small_policy(weight_dtype))[layer, head, what]
        return put(blob, offset + index * struct.calcsize(fmt), fmt, value)

    return mutate


def set_arch(raw: bytes):
    return lambda blob: put(blob, ARCH_OFFSET, "32s", raw)


def set_pos(index: int, kind: int, a: float):
    return lambda blob: put(blob, HEADER + 8 * index, "<If", kind, a)


def set_layer_flags(*flags: int):
    start = HEADER + 8 * 2
    return lambda blob: put(blob, start, f"<{len(flags)}I", *flags)


F16_NAN, F16_INF = 0x7E00, 0x7C00

# (id, mutation of the small valid file, text both messages contain); ids starting 'f16-' mutate the f16 file.
MALFORMED = [
    ("short-header", lambda b: b[:127], "128-byte header"),
    ("empty", lambda b: b"", "128-byte header"),
    ("magic", lambda b: b"KVPOLICX" + b[8:], "magic"),
    ("version", lambda b: put_field(b, "version", 3), "version=3"),
    ("version-0", lambda b: put_field(b, "version", 0), "version=0"),
    ("v1-recency-knots", lambda b: put_field(b, "n_recency_knots", 2), "reserved header bytes are not zero"),
    ("v2-without-knots", lambda b: put_field(b, "version", 2), "n_recency_knots=0 is outside 1..32"),
    ("header-bytes", lambda b: put_field(b, "header_bytes", 256), "header_bytes=256"),
    ("file-bytes-larger", lambda b: put_field(b, "file_bytes", len(b) + 1, fix_crc=False), "file_bytes"),
    ("file-bytes-smaller", lambda b: put_field(b, "file_bytes", len(b) - 1, fix_crc=False), "file_bytes"),
    ("appended-byte", lambda b: b + b"\0", "file_bytes"),
    ("truncated", lambda b: b[:-1], "file_bytes"),
    ("no-room-for-checksum", lambda b: put_field(b[:130], "file_bytes", 130, fix_crc=False), "checksum"),
    ("checksum-flipped", lambda b: b[:-1] + bytes([b[-1] ^ 1]), "checksum"),
    ("payload-flipped", lambda b: b[:200] + bytes([b[200] ^ 0x10]) + b[201:], "checksum"),
    ("arch-no-nul", set_arch(b"x" * 32), "arch"),
    ("arch-empty", set_arch(b""), "arch is empty"),
    ("arch-not-padded", set_arch(b"tiny\0x"), "arch is not NUL-padded"),
    ("arch-not-utf8", set_arch(b"ti\xffny"), "arch is not valid UTF-8"),
    *[
        (f"{name}={value}", (lambda n, v: lambda b: put_field(b, n, v))(name, value), f"{name}={value}")
        for name, values in {
            "n_layer": [0, 1025], "n_head_kv": [0, 257], "head_dim_k": [0, 1025], "head_dim_v": [0, 1025],
            "n_ctx_train": [0], "n_pos_features": [17, 0xFFFFFFFF], "n_dense": [0, 5], "activation": [4],
            "weight_dtype": [2], "hidden[0]": [0, 4097],
        }.items()
        for value in values
    ],  # fmt: skip
    ("unused-hidden-nonzero", lambda b: put_field(b, "hidden[1]", 3), "hidden[1]=3 must be 0"),
    ("metadata-bytes-over-limit", lambda b: put_field(b, "metadata_bytes", (16 << 20) + 1), "metadata_bytes"),
    ("metadata-bytes-past-end", lambda b: put_field(b, "metadata_bytes", 5000), "file_bytes"),
    ("reserved", lambda b: put_field(b, "reserved", 1 << 40), "reserved"),
    ("sections-longer", lambda b: put_field(b, "n_head_kv", 3), "sections require"),
    ("sections-shorter-dims", lambda b: put_field(b, "head_dim_k", 2), "sections require"),
    ("sections-shorter", lambda b: put_field(b, "hidden[0]", 3), "sections require"),
    ("more-dense-layers", lambda b: put_field(put_field(b, "n_dense", 3), "hidden[1]", 2), "sections require"),
    ("weight-dtype-f16", lambda b: put_field(b, "weight_dtype", 1), "sections require"),
    ("pos-kind", set_pos(1, 4, 1.0), "position feature 1: kind=4"),
    ("pos-a-nan", set_pos(0, 2, float("nan")), "position feature 0: a is not finite"),
    ("pos-a-inf", set_pos(0, 0, float("inf")), "position feature 0: a is not finite"),
    ("pos-linear-zero", set_pos(1, 0, 0.0), "position feature 1: a is zero"),
    ("pos-log-zero", set_pos(0, 1, -0.0), "position feature 0: a is zero"),
    ("layer-flag-bits", set_layer_flags(1, 2), "layer flag of layer 1"),
    ("layer-flags-none", set_layer_flags(0, 0), "no layer has agents"),
    ("shift-nan", set_value("shift", 0, 1, 3, "<f", float("nan")), "agent (layer 0, head 1): shift[3] is not finite"),
    ("scale-inf", set_value("scale", 0, 0, 0, "<f", float("-inf")), "agent (layer 0, head 0): scale[0]"),
    ("weight-nan", set_value("dense 0 weight", 0, 1, 27, "<f", float("nan")), "(layer 0, head 1): dense 0 weight[27]"),
    ("bias-inf", set_value("dense 1 bias", 0, 0, 0, "<f", float("inf")), "(layer 0, head 0): dense 1 bias[0]"),
    ("f16-weight-nan", set_value("dense 1 weight", 0, 1, 2, "<H", F16_NAN), "(layer 0, head 1): dense 1 weight[2]"),
    ("f16-bias-inf", set_value("dense 0 bias", 0, 0, 3, "<H", F16_INF), "(layer 0, head 0): dense 0 bias[3]"),
    ("metadata-not-utf8", set_metadata(b'{"a": "\xc3\x28"}'), "metadata is not valid UTF-8"),
    ("metadata-surrogate", set_metadata(b'{"a": "\xed\xa0\x80"}'), "metadata is not valid UTF-8"),
    ("metadata-overlong", set_metadata(b'{"a": "\xc0\xaf"}'), "metadata is not valid UTF-8"),
    ("metadata-truncated-utf8", set_metadata(b'{"a": 1}\xe6\xbc'), "metadata is not valid UTF-8"),
    ("metadata-array", set_metadata(b"[1, 2]"), "metadata is not a JSON object"),
    ("metadata-empty", set_metadata(b""), "metadata is not a JSON object"),
    ("metadata-string", set_metadata(b'"{}"'), "metadata is not a JSON object"),
    ("metadata-open-brace", set_metadata(b" { "), "metadata is not a JSON object"),
]


@pytest.mark.parametrize("case, mutate, expected", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_file_rejected_by_both_readers(case, mutate, expected):
    blob = encode_policy(small_policy("f16" if case.startswith("f16-") else "f32"))
    py_message, cpp_message = both_reject(mutate(blob))
    assert expected in py_message
    assert py_message == cpp_message  # same checks in the same order


def test_metadata_json_is_parsed_by_python_only(small_blob):
    # The C++ loader only checks UTF-8 and the surrounding braces (it never reads the metadata); Python parses it.
    blob = with_metadata(small_blob, b"  {not json}\n")
    with pytest.raises(PolicyFormatError, match="metadata is not valid JSON"):
        decode_policy(blob)
    assert _core.parse_policy(blob).metadata_json == "  {not json}\n"


def test_valid_edge_values_accepted(small_blob):
    blob = with_metadata(small_blob, b' \r\n\t{"k": "\xe6\xbc\xa2"} ')
    blob = put_field(put_field(blob, "n_sink", 0xFFFFFFFF), "n_recent", 0)
    blob = set_pos(0, 2, 0.0)(blob)  # a = 0 is fine for sine and cosine
    data = decode_policy(blob)
    assert (data.n_sink, data.n_recent, data.metadata, data.pos_features[0]) == (0xFFFFFFFF, 0, {"k": "\u6f22"}, (2, 0.0))
    assert_core_matches(_core.parse_policy(blob), data)


def test_lying_header_claiming_huge_sizes_fails_before_allocating(small_blob):
    huge = small_blob
    for name, value in {
        "n_layer": 1024, "n_head_kv": 256, "head_dim_k": 1024, "head_dim_v": 1024, "n_pos_features": 16,
        "n_dense": 4, "hidden[0]": 4096, "hidden[1]": 4096, "hidden[2]": 4096,
    }.items():  # fmt: skip
        huge = put_field(huge, name, value)
    for py_message, cpp_message in (
        both_reject(huge),
        both_reject(put_field(huge, "metadata_bytes", 16 << 20)),
        both_reject(put_field(small_blob, "file_bytes", 2**64 - 1, fix_crc=False)),
    ):
        assert "file_bytes" in py_message and "file_bytes" in cpp_message
    # Everything but the agents present, with 1024 x 256 agents of ~170 MB each claimed on top.
    header = put_field(huge, "metadata_bytes", 2)[:HEADER]
    lying = refresh(header + struct.pack("<If", 2, 0.0) * 16 + struct.pack("<I", 1) * 1024 + b"{}" + bytes(4))
    py_message, cpp_message = both_reject(lying)
    assert "sections require" in py_message and py_message == cpp_message


def test_truncation_at_every_byte_is_a_clean_error(small_blob):
    for size in range(len(small_blob)):
        py_message, cpp_message = both_reject(small_blob[:size])
        expected = "128-byte header" if size < HEADER else f"file_bytes={len(small_blob)} but the file is {size} bytes"
        assert expected in py_message and expected in cpp_message


def test_load_errors_name_the_path(tmp_path, small_blob):
    missing = tmp_path / "missing.kvp.bin"
    for reader in (read_policy, _core.load_policy):
        with pytest.raises(ERRORS, match="missing.kvp.bin"):
            reader(str(missing))
        with pytest.raises(ERRORS, match=str(tmp_path.name)):
            reader(str(tmp_path))  # a directory
    bad = tmp_path / "bad.kvp.bin"
    bad.write_bytes(small_blob[:-3])
    for reader in (read_policy, _core.load_policy):
        with pytest.raises(ERRORS, match=r"bad\.kvp\.bin.*file_bytes"):
            reader(str(bad))


# --- the writer refuses what the format cannot hold ---------------------------------------------------------------


def _replace_agent_array(data: PolicyData, what: str, value) -> PolicyData:
    agent = data.agents[0, 1]
    if what == "shift":
        agent.shift = value
    else:
        agent.weights[0] = value
    return data


INVALID_DATA = [
    ("n_layer", lambda d: dataclasses.replace(d, n_layer=0), "n_layer=0"),
    ("n_head_kv", lambda d: dataclasses.replace(d, n_head_kv=300), "n_head_kv=300"),
    ("n_ctx_train", lambda d: dataclasses.replace(d, n_ctx_train=2**32), "n_ctx_train"),
    ("n_sink", lambda d: dataclasses.replace(d, n_sink=-1), "n_sink=-1"),
    ("activation", lambda d: dataclasses.replace(d, activation="gelu"), "activation"),
    ("weight_dtype", lambda d: dataclasses.replace(d, weight_dtype="bf16"), "weight_dtype"),
    ("hidden-width", lambda d: dataclasses.replace(d, hidden=[5000]), "hidden[0]=5000"),
    ("hidden-count", lambda d: dataclasses.replace(d, hidden=[4, 4, 4, 4]), "n_dense=5"),
    ("arch-long", lambda d: dataclasses.replace(d, arch="a" * 32), "arch"),
    ("arch-empty", lambda d: dataclasses.replace(d, arch=""), "arch is empty"),
    ("arch-nul", lambda d: dataclasses.replace(d, arch="ti\0ny"), "arch is not NUL-padded"),
    ("pos-kind", lambda d: dataclasses.replace(d, pos_features=[(5, 1.0)]), "position feature 0: kind=5"),
    ("pos-zero", lambda d: dataclasses.replace(d, pos_features=[(1, 1e-60)]), "position feature 0: a is zero"),
    ("pos-overflow", lambda d: dataclasses.replace(d, pos_features=[(2, 1e300)]), "position feature 0: a is not finite"),
    ("pos-too-many", lambda d: dataclasses.replace(d, pos_features=[(2, 1.0)] * 17), "n_pos_features=17"),
    ("layer-scored-length", lambda d: dataclasses.replace(d, layer_scored=[True]), "layer_scored"),
    ("no-scored-layer", lambda d: dataclasses.replace(d, layer_scored=[False, False]), "no layer has agents"),
    ("agent-missing", lambda d: dataclasses.replace(d, agents={(0, 0): d.agents[0, 0]}), "agents"),
    ("agent-extra", lambda d: dataclasses.replace(d, layer_scored=[False, True]), "agents"),
    ("shape", lambda d: _replace_agent_array(d, "weight", np.zeros((4, 6), np.float32)), "dense 0 weight has shape"),
    ("shift-nan", lambda d: _replace_agent_array(d, "shift", np.full(7, np.nan)), "(layer 0, head 1): shift[0]"),
    ("metadata-type", lambda d: dataclasses.replace(d, metadata={"x": object()}), "metadata"),
    ("metadata-nan", lambda d: dataclasses.replace(d, metadata={"x": float("nan")}), "metadata"),
    ("metadata-list", lambda d: dataclasses.replace(d, metadata=[1]), "metadata is not a JSON object"),
]


@pytest.mark.parametrize("mutate, expected", [m[1:] for m in INVALID_DATA], ids=[m[0] for m in INVALID_DATA])
def test_encode_rejects_invalid_data(mutate, expected):
    with pytest.raises(PolicyFormatError) as e:
        encode_policy(mutate(small_policy()))
    assert expected in str(e.value)


def test_encode_rejects_weights_that_overflow_f16():
    data = small_policy("f16")
    data.agents[0, 0].biases[1] = np.array([1e6], np.float32)
    with pytest.raises(PolicyFormatError, match=r"\(layer 0, head 0\): dense 1 bias\[0\] is not finite"):
        encode_policy(data)


# --- mutation fuzzing -----------------------------------------------------------------------------------------------

HEADER_SLOTS = [(offset, "<I") for offset in U32_FIELDS.values()] + [(offset, "<Q") for offset in U64_FIELDS.values()]


def random_mutation(rng: np.random.Generator, blob: bytes) -> bytes:
    out = bytearray(blob)
    kind = rng.integers(5)
    if kind == 0:  # flip 1..4 random bits
        for _ in range(rng.integers(1, 5)):
            out[rng.integers(len(out))] ^= 1 << int(rng.integers(8))
    elif kind == 1:  # overwrite random bytes
        for _ in range(rng.integers(1, 9)):
            out[rng.integers(len(out))] = rng.integers(256)
    elif kind == 2:  # a header field gets a random value: mostly small, sometimes anything
        offset, fmt = HEADER_SLOTS[rng.integers(len(HEADER_SLOTS))]
        bits = 32 if fmt == "<I" else 64
        value = int(rng.integers(0, 2**bits, dtype=np.uint64)) if rng.random() < 0.5 else int(rng.integers(0, 5000))
        struct.pack_into(fmt, out, offset, value)
    elif kind == 3:
        del out[rng.integers(len(out)) :]
    else:
        out += rng.integers(0, 256, rng.integers(1, 17), dtype=np.uint8).tobytes()
    return bytes(out)


def parse_both(blob: bytes):
    """(PolicyData or Python error message, C++ Policy or C++ error message)."""
    try:
        py = decode_policy(blob)
    except PolicyFormatError as e:
        py = str(e)
    try:
        cc = _core.parse_policy(blob)
    except _core.PolicyFormatError as e:
        cc = str(e)
    return py, cc


def test_random_mutations_never_crash_or_change_content():
    rng = np.random.default_rng(2024)
    blobs = [encode_policy(small_policy()), encode_policy(small_policy("f16", hidden=(3, 2), pos=[(3, 0.5)])),
             encode_policy(with_recency(small_policy()))]
    originals = [decode_policy(b) for b in blobs]
    rejected = 0
    for i in range(3000):
        which = i % 3
        mutated = random_mutation(rng, blobs[which])
        py, cc = parse_both(mutated)
        if mutated == blobs[which]:
            continue
        if isinstance(py, str) and isinstance(cc, str):
            rejected += 1
            continue
        # Accepting a corrupted file is only tolerable if it decodes to exactly the original content.
        assert not isinstance(py, str) and not isinstance(cc, str), (py, cc)
        assert_same_data(py, originals[which])
        assert_core_matches(cc, originals[which])
    assert rejected > 2850


def test_checksum_fixed_mutations_agree_between_readers():
    """With the CRC re-stamped, field validation is what stands between a mutation and the scorer; both readers
    must take the same decision, with the same message, and read the same content when they accept."""
    rng = np.random.default_rng(99)
    blobs = [encode_policy(small_policy()), encode_policy(small_policy("f16", hidden=(3, 2), pos=[(3, 0.5)])),
             encode_policy(with_recency(small_policy()))]
    metadata_starts = [len(b) - 4 - struct.unpack_from("<Q", b, U64_FIELDS["metadata_bytes"])[0] for b in blobs]
    accepted = rejected = 0
    for i in range(2250):
        which = i % 3
        body = random_mutation(rng, blobs[which][:-4])
        if body[metadata_starts[which] :] != blobs[which][metadata_starts[which] : -4]:
            continue  # JSON syntax is checked by Python only; keep the metadata (and so the length) intact here
        mutated = bytearray(body + bytes(4))
        if rng.random() < 0.8:
            mutated = refresh(mutated)
        else:  # keep a possibly lying file_bytes, only re-stamp the CRC
            mutated = put(mutated, len(mutated) - 4, "<I", zlib.crc32(body), fix_crc=False)
        py, cc = parse_both(mutated)
        if isinstance(py, str) or isinstance(cc, str):
            assert py == cc
            rejected += 1
        else:
            assert_core_matches(cc, py)
            accepted += 1
    assert rejected > 100 and accepted > 20
