"""ONNX export (training.export_onnx) and conversion back to kvp.bin (training.onnx_to_kvp), docs/onnx.md."""
import json
import os
import sys

# `training` is a top-level directory of the repository, not part of the installed kvp_cpp package: put the repository
# root on sys.path so these tests import it wherever pytest runs from.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import pytest  # noqa: E402

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

import kvp_cpp  # noqa: E402
from kvp_cpp import policy_file as pf  # noqa: E402
from training import export_onnx, onnx_to_kvp  # noqa: E402

SMOLLM2 = pf.smollm2_identity()
POLICIES = {
    "smollm2_relu_f32": dict(**SMOLLM2, hidden=(32,), activation="relu", weight_dtype="f32"),
    "smollm2_gelu_2hidden_f32": dict(**SMOLLM2, hidden=(32, 16), activation="gelu_tanh", weight_dtype="f32"),
    "unscored_layers_silu_f16": dict(
        arch="gemma3", n_layer=6, n_head_kv=2, head_dim_k=16, head_dim_v=12, n_ctx_train=4096, hidden=(24,),
        activation="silu", weight_dtype="f16", layer_scored=[False, True, True, False, False, True],
        pos=[(0, 4096.0), (1, 8.3), (2, 0.01), (3, 0.003)],
        metadata={"note": "überprüft ✓", "steps": [1, 2.5, None], "nested": {"a": True}},
    ),
    "no_hidden_no_pos_tanh_f16": dict(
        arch="test", n_layer=2, n_head_kv=4, head_dim_k=13, head_dim_v=9, n_ctx_train=512, hidden=(),
        activation="tanh", weight_dtype="f16", pos=[],
    ),
    "three_hidden_gelu_f16": dict(
        arch="test", n_layer=3, n_head_kv=1, head_dim_k=8, head_dim_v=8, n_ctx_train=2048, hidden=(7, 5, 3),
        activation="gelu_tanh", weight_dtype="f16", layer_scored=[True, False, True],
    ),
}
RTOL = {"f32": 1e-4, "f16": 1e-2}


def make_policy(name):
    return pf.random_policy(seed=sorted(POLICIES).index(name), **POLICIES[name])


@pytest.fixture(scope="module", params=sorted(POLICIES))
def exported(request):
    data = make_policy(request.param)
    return data, export_onnx.policy_to_onnx(data)


def random_inputs(data, n_tokens=37, seed=0):
    """Graph inputs k [S, H, T, dk], v [S, H, T, dv], pos_features [T, P], and the positions they came from."""
    rng = np.random.default_rng(seed)
    n_scored = sum(data.layer_scored)
    k = (rng.standard_normal((n_scored, data.n_head_kv, n_tokens, data.head_dim_k)) * 2).astype(np.float32)
    v = rng.standard_normal((n_scored, data.n_head_kv, n_tokens, data.head_dim_v)).astype(np.float32)
    positions = rng.integers(0, 3 * data.n_ctx_train, n_tokens).astype(np.int64)  # beyond n_ctx_train too
    return {"k": k, "v": v, "pos_features": pf.pos_features(data.pos_features, positions)}, positions


def run_onnxruntime(model, inputs):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (scores,) = session.run(["scores"], inputs)
    return scores


def layer_inputs(inputs, s):
    """k, v of scored layer s in the C++ scorer's (T, H, d) layout."""
    return tuple(np.ascontiguousarray(inputs[name][s].transpose(1, 0, 2)) for name in ("k", "v"))


def native_scores(policy, data, inputs, positions):
    """The C++ scorer's (T, H) scores of every scored layer, stacked as the graph's [S, H, T]."""
    scorer = kvp_cpp.Scorer(policy)
    return np.stack([scorer.score_layer(layer, *layer_inputs(inputs, s), positions).T
                     for s, layer in enumerate(export_onnx.scored_layers(data))])


def reference(data, inputs, positions):
    return np.stack([pf.reference_scores(data, layer, *layer_inputs(inputs, s), positions).T
                     for s, layer in enumerate(export_onnx.scored_layers(data))])


def assert_close(actual, expected, rtol):
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * max(1.0, float(np.abs(expected).max())))


def test_exported_graph_passes_the_full_checker(exported):
    data, model = exported
    onnx.checker.check_model(model, full_check=True)
    assert [(o.domain, o.version) for o in model.opset_import] == [("", export_onnx.OPSET)]
    assert [i.name for i in model.graph.input] == ["k", "v", "pos_features"]
    assert [o.name for o in model.graph.output] == ["scores"]
    props = {p.key for p in model.metadata_props}
    assert props == {export_onnx.HEADER_KEY, export_onnx.METADATA_KEY}


def test_onnxruntime_matches_cpp_scorer_and_reference(exported):
    data, model = exported
    inputs, positions = random_inputs(data)
    scores = run_onnxruntime(model, inputs)
    assert scores.shape == (sum(data.layer_scored), data.n_head_kv, len(positions)) and scores.dtype == np.float32
    native = native_scores(kvp_cpp.parse_policy(pf.encode_policy(data)), data, inputs, positions)
    expected = reference(data, inputs, positions)
    rtol = RTOL[data.weight_dtype]
    assert_close(scores, native, rtol)
    assert_close(scores, expected, rtol)
    assert_close(native, expected, rtol)


def test_round_trip_is_byte_identical(exported):
    data, model = exported
    blob = onnx_to_kvp.convert(model)
    assert blob == pf.encode_policy(data)
    assert pf.decode_policy(blob).metadata == data.metadata


def test_converted_policy_scores_like_the_graph(exported):
    data, model = exported
    inputs, positions = random_inputs(data, n_tokens=50, seed=1)
    policy = kvp_cpp.parse_policy(onnx_to_kvp.convert(model))
    native = native_scores(policy, data, inputs, positions)
    assert_close(native, run_onnxruntime(model, inputs), RTOL[data.weight_dtype])


def test_command_lines_round_trip_through_files(tmp_path):
    data = make_policy("unscored_layers_silu_f16")
    pf.write_policy(tmp_path / "in.kvp.bin", data)
    assert export_onnx.main([str(tmp_path / "in.kvp.bin"), "-o", str(tmp_path / "p.onnx")]) == 0
    assert onnx_to_kvp.main([str(tmp_path / "p.onnx"), "-o", str(tmp_path / "out.kvp.bin")]) == 0
    assert (tmp_path / "out.kvp.bin").read_bytes() == (tmp_path / "in.kvp.bin").read_bytes()
    assert onnx_to_kvp.convert(tmp_path / "p.onnx") == pf.encode_policy(data)
    kvp_cpp.load_policy(str(tmp_path / "out.kvp.bin"))


def test_command_line_reports_a_file_that_is_not_onnx(tmp_path, capsys):
    (tmp_path / "junk.onnx").write_bytes(b"\xff" * 64)
    assert onnx_to_kvp.main([str(tmp_path / "junk.onnx"), "-o", str(tmp_path / "out.kvp.bin")]) == 1
    assert "is not an ONNX model" in capsys.readouterr().err
    assert not (tmp_path / "out.kvp.bin").exists()


def test_f32_values_in_an_f16_policy_are_rounded_to_f16():
    data = make_policy("three_hidden_gelu_f16")
    model = export_onnx.policy_to_onnx(data)
    weight = next(t for t in model.graph.initializer if t.name == "dense1.weight")
    values = onnx.numpy_helper.to_array(weight) * np.float32(1.0 + 2.0**-20)  # no longer f16-representable
    weight.CopyFrom(onnx.numpy_helper.from_array(values, "dense1.weight"))
    converted = pf.decode_policy(onnx_to_kvp.convert(model))
    layer, head = 2, 0
    np.testing.assert_array_equal(converted.agents[layer, head].weights[1], values[1, head].T.astype(np.float16))


# --- rejections: each edits one thing of a valid exported graph ---------------------------------------------------


def _node(model, op_type, nth=0):
    return [node for node in model.graph.node if node.op_type == op_type][nth]


def _initializer(model, name):
    return next(t for t in model.graph.initializer if t.name == name)


def _replace_initializer(model, name, values):
    _initializer(model, name).CopyFrom(onnx.numpy_helper.from_array(values, name))


def _rename_input(model, old, new):
    next(i for i in model.graph.input if i.name == old).name = new
    for node in model.graph.node:
        node.input[:] = [new if name == old else name for name in node.input]


def _set_prop(model, key, value):
    next(p for p in model.metadata_props if p.key == key).value = value


def _drop_prop(model, key):
    kept = [p for p in model.metadata_props if p.key != key]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)


def _nan_weight(model):
    values = onnx.numpy_helper.to_array(_initializer(model, "dense0.weight")).copy()
    values[1, 0, 2, 3] = np.nan  # scored layer 1 is layer 2; kvp.bin rows are (n_out, n_in): 3 * 18 + 2
    _replace_initializer(model, "dense0.weight", values)


def _extra_node(model):
    _node(model, "Squeeze").output[0] = "squeezed"
    model.graph.node.append(onnx.helper.make_node("Tanh", ["squeezed"], ["scores"]))


def _swap_sub_mul(model):
    sub, mul = _node(model, "Sub"), _node(model, "Mul")
    sub.op_type, mul.op_type = "Mul", "Sub"


def _rewire_matmul(model):
    _node(model, "MatMul", 1).input[0] = "normalized"


def _wider_weight(model):
    values = onnx.numpy_helper.to_array(_initializer(model, "dense0.weight"))
    _replace_initializer(model, "dense0.weight", np.concatenate([values, values[..., :1]], axis=-1))


def _rename_output(model):
    model.graph.output[0].name = _node(model, "Squeeze").output[0] = "logits"


def _double_bias(model):
    values = onnx.numpy_helper.to_array(_initializer(model, "dense0.bias"))
    _replace_initializer(model, "dense0.bias", values.astype(np.float64))


def _rename_scale(model):
    _initializer(model, "scale").name = _node(model, "Mul").input[1] = "scales"


def _fixed_token_dim(model):
    dim = model.graph.input[0].type.tensor_type.shape.dim[2]
    dim.dim_value = 128


REJECTIONS = {
    "unsupported_op": (lambda m: setattr(_node(m, "Tanh"), "op_type", "Erf"), r"op Erf is not part of the supported"),
    "wrong_input_name": (lambda m: _rename_input(m, "k", "keys"), r"input 0 is 'keys'.*expected 'k'"),
    "wrong_input_shape": (
        lambda m: setattr(m.graph.input[1].type.tensor_type.shape.dim[3], "dim_value", 65),
        r"input 1 is 'v' FLOAT \[2, 1, 'n_tokens', 65\], expected 'v' FLOAT \[2, 1, 'n_tokens', 8\]",
    ),
    "fixed_token_dim": (_fixed_token_dim, r"input 0 is 'k' FLOAT \[2, 1, 128, 8\], expected .*'n_tokens'"),
    "wrong_output_name": (_rename_output, r"output 0 is 'logits'"),
    "missing_header": (lambda m: _drop_prop(m, "kvp.header"), r"metadata_props has no 'kvp.header' entry"),
    "metadata_not_json": (lambda m: _set_prop(m, "kvp.metadata", "{oops"), r"'kvp.metadata' is not valid JSON"),
    "unknown_activation": (
        lambda m: _set_prop(m, "kvp.header", _header_json(m).replace('"gelu_tanh"', '"swish"')),
        r"activation='swish' is not one of",
    ),
    "wrong_opset": (lambda m: setattr(m.opset_import[0], "version", 18), r"opset_import is \{'ai.onnx': 18\}"),
    "non_float_initializer": (_double_bias, r"initializer 'dense0.bias' has dtype DOUBLE, expected FLOAT"),
    "renamed_initializer": (_rename_scale, r"initializers \['scale'\] are missing"),
    "initializer_shape_mismatch": (_wider_weight, r"initializer 'dense0.weight' has shape \[2, 1, 18, 8\], expected "
                                                  r"\[2, 1, 18, 7\]"),
    "wrong_activation_constant": (
        lambda m: _replace_initializer(m, "gelu.cubic", np.array(0.05, np.float32)),
        r"initializer 'gelu.cubic' holds",
    ),
    "swapped_sub_mul": (_swap_sub_mul, r"node 2 .*\(Mul\): expected op Sub here"),
    "rewired_matmul": (_rewire_matmul, r"\(MatMul\): inputs \['normalized', 'dense1.weight'\] are wired as"),
    "concat_axis": (
        lambda m: setattr(_node(m, "Concat").attribute[0], "i", -1), r"\(Concat\): attributes \['axis = -1'\]"
    ),
    "extra_node": (_extra_node, r"graph has \d+ nodes, the pattern .* has \d+"),
    "nan_weight": (_nan_weight, r"agent \(layer 2, head 0\): dense 0 weight\[56\] is not finite"),
}


def _header_json(model):
    return next(p.value for p in model.metadata_props if p.key == "kvp.header")


@pytest.fixture(scope="module")
def valid_model():
    return export_onnx.policy_to_onnx(make_policy("three_hidden_gelu_f16"))


@pytest.mark.parametrize("case", sorted(REJECTIONS))
def test_converter_rejects_malformed_graphs(valid_model, case):
    edit, message = REJECTIONS[case]
    model = onnx.ModelProto()
    model.CopyFrom(valid_model)
    edit(model)
    with pytest.raises(ValueError, match=message):
        onnx_to_kvp.convert(model)


def test_unedited_graph_is_accepted(valid_model):
    assert onnx_to_kvp.convert(valid_model) == pf.encode_policy(make_policy("three_hidden_gelu_f16"))


def with_recency(data, knots=5, seed=4):
    rng = np.random.default_rng(seed)
    data.recency = {key: rng.standard_normal(knots).astype(np.float32) for key in sorted(data.agents)}
    return data


@pytest.mark.parametrize("name", ["smollm2_relu_f32", "unscored_layers_silu_f16"])
def test_recency_terms_travel_beside_the_graph(name):
    data = with_recency(make_policy(name))
    model = export_onnx.policy_to_onnx(data)
    onnx.checker.check_model(model, full_check=True)
    stored = json.loads(next(p.value for p in model.metadata_props if p.key == export_onnx.RECENCY_KEY))
    assert stored["knots"] == 5 and len(stored["values"]) == sum(data.layer_scored)
    blob = onnx_to_kvp.convert(model)
    assert blob == pf.encode_policy(data)  # a version 2 file, recency terms bit for bit
    # the graph itself is the same as without them
    plain = export_onnx.policy_to_onnx(make_policy(name))
    assert model.graph == plain.graph


@pytest.mark.parametrize("edit, message", [
    (lambda values: values["values"].pop(), r"'kvp.recency' is not \{'knots': K"),
    (lambda values: values.update(knots=6), r"'kvp.recency' is not \{'knots': K"),
    (lambda values: values["values"][0][0].__setitem__(2, "x"), r"'kvp.recency' is not \{'knots': K"),
    (lambda values: values["values"][0][0].__setitem__(1, float("nan")), r"\(layer 0, head 0\): recency\[1\] is not finite"),
])  # fmt: skip
def test_converter_rejects_malformed_recency_terms(edit, message):
    model = export_onnx.policy_to_onnx(with_recency(make_policy("smollm2_relu_f32")))
    values = json.loads(next(p.value for p in model.metadata_props if p.key == export_onnx.RECENCY_KEY))
    edit(values)
    _set_prop(model, export_onnx.RECENCY_KEY, json.dumps(values))
    with pytest.raises(ValueError, match=message):
        onnx_to_kvp.convert(model)
