"""Convert an ONNX policy graph (the pattern training.export_onnx writes, docs/onnx.md) back to kvp.bin.

    python -m training.onnx_to_kvp model.onnx -o model.kvp.bin

The graph's metadata gives the policy's dimensions; from them the exporter's own layout functions give the graph
the policy must be, and the given graph is compared against it: inputs, outputs, initializers (names, dtypes,
shapes, constant values) and nodes (op, attributes, wiring; intermediate tensor and node names are free). Anything
else is a ValueError naming the first difference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import numpy_helper

from kvp_cpp import policy_file as pf
from training import export_onnx as layout

__all__ = ["onnx_to_policy", "convert", "main"]

_HEADER_FIELDS = (
    "contract_version", "arch", "n_layer", "n_head_kv", "head_dim_k", "head_dim_v", "n_ctx_train", "pos_features",
    "hidden", "activation", "weight_dtype", "n_sink", "n_recent", "layer_scored",
)  # fmt: skip


def _fail(message: str):
    raise ValueError(message)


def _check_opset(model: onnx.ModelProto) -> None:
    imports = {entry.domain or "ai.onnx": entry.version for entry in model.opset_import}
    if imports != {"ai.onnx": layout.OPSET}:
        _fail(f"opset_import is {imports}, expected only ai.onnx version {layout.OPSET}")


def _json_prop(props: dict, key: str) -> dict:
    if key not in props:
        _fail(f"metadata_props has no '{key}' entry (not a graph written by training.export_onnx?)")
    try:
        value = json.loads(props[key])
    except ValueError as e:
        _fail(f"metadata_props '{key}' is not valid JSON: {e}")
    if not isinstance(value, dict):
        _fail(f"metadata_props '{key}' is not a JSON object")
    return value


def _policy_skeleton(model: onnx.ModelProto) -> pf.PolicyData:
    """The PolicyData described by the metadata, without agents. Field ranges are left to pf.encode_policy."""
    props = {prop.key: prop.value for prop in model.metadata_props}
    header = _json_prop(props, layout.HEADER_KEY)
    metadata = _json_prop(props, layout.METADATA_KEY)
    missing = [name for name in _HEADER_FIELDS if name not in header]
    unknown = sorted(set(header) - set(_HEADER_FIELDS))
    if missing or unknown:
        _fail(f"metadata_props '{layout.HEADER_KEY}': missing fields {missing}, unknown fields {unknown}")
    if header["contract_version"] != layout.CONTRACT_VERSION:
        version = header["contract_version"]
        _fail(f"'{layout.HEADER_KEY}' contract_version={version!r}, expected {layout.CONTRACT_VERSION}")
    for name in ("n_layer", "n_head_kv", "head_dim_k", "head_dim_v", "n_ctx_train", "n_sink", "n_recent"):
        if not isinstance(header[name], int) or isinstance(header[name], bool):
            _fail(f"'{layout.HEADER_KEY}' {name}={header[name]!r} is not an integer")
    if header["activation"] not in pf.ACTIVATIONS:
        _fail(f"'{layout.HEADER_KEY}' activation={header['activation']!r} is not one of {pf.ACTIVATIONS}")
    if header["weight_dtype"] not in pf.WEIGHT_DTYPES:
        _fail(f"'{layout.HEADER_KEY}' weight_dtype={header['weight_dtype']!r} is not one of {pf.WEIGHT_DTYPES}")
    hidden, scored = header["hidden"], header["layer_scored"]
    if not isinstance(hidden, list) or not all(isinstance(w, int) and not isinstance(w, bool) for w in hidden):
        _fail(f"'{layout.HEADER_KEY}' hidden={hidden!r} is not a list of integers")
    if not isinstance(scored, list) or not all(isinstance(s, bool) for s in scored) or not any(scored):
        _fail(f"'{layout.HEADER_KEY}' layer_scored={scored!r} is not a list of booleans with at least one true")
    features = []
    for index, feature in enumerate(header["pos_features"]):
        if not isinstance(feature, dict) or feature.get("kind") not in pf.POS_FEATURE_KINDS \
                or not isinstance(feature.get("a"), (int, float)) or isinstance(feature.get("a"), bool):
            _fail(f"'{layout.HEADER_KEY}' pos_features[{index}]={feature!r} is not "
                  f"{{'kind': one of {pf.POS_FEATURE_KINDS}, 'a': number}}")
        features.append((pf.POS_FEATURE_KINDS.index(feature["kind"]), float(feature["a"])))
    fields = {name: header[name] for name in _HEADER_FIELDS if name not in ("contract_version", "pos_features")}
    data = pf.PolicyData(**fields, pos_features=features, metadata=metadata)
    if layout.RECENCY_KEY in props:
        data.recency = _recency(_json_prop(props, layout.RECENCY_KEY), data)
    return data


def _recency(recency: dict, data: pf.PolicyData) -> dict:
    """The recency terms stored under RECENCY_KEY, {"knots": K, "values": [S][H][K]}, keyed (layer, head)."""
    knots, values = recency.get("knots"), recency.get("values")
    layers = layout.scored_layers(data)
    shape_ok = isinstance(knots, int) and isinstance(values, list) and len(values) == len(layers) and all(
        isinstance(heads, list) and len(heads) == data.n_head_kv and all(
            isinstance(row, list) and len(row) == knots and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in row) for row in heads)
        for heads in values)  # fmt: skip
    if not shape_ok:
        _fail(f"metadata_props '{layout.RECENCY_KEY}' is not {{'knots': K, 'values': [{len(layers)} scored layers]"
              f"[{data.n_head_kv} heads][K numbers]}}")
    return {(layer, head): np.array(values[s][head], np.float32)
            for s, layer in enumerate(layers) for head in range(data.n_head_kv)}  # fmt: skip


def _describe_value(value: onnx.ValueInfoProto) -> str:
    tensor = value.type.tensor_type
    dims = [d.dim_param if d.HasField("dim_param") else d.dim_value if d.HasField("dim_value") else "?"
            for d in tensor.shape.dim]
    dtype = onnx.TensorProto.DataType.Name(tensor.elem_type) if tensor.elem_type else "untyped"
    return f"'{value.name}' {dtype} {dims}"


def _check_values(kind: str, actual, expected) -> None:
    actual_desc = [_describe_value(v) for v in actual]
    expected_desc = [_describe_value(v) for v in expected]
    if len(actual_desc) != len(expected_desc):
        _fail(f"graph has {len(actual_desc)} {kind}s {actual_desc}, expected {len(expected_desc)}: {expected_desc}")
    for index, (a, e) in enumerate(zip(actual_desc, expected_desc)):
        if a != e:
            _fail(f"{kind} {index} is {a}, expected {e}")


def _initializer_arrays(graph: onnx.GraphProto, data: pf.PolicyData) -> dict:
    """Name -> numpy array of every initializer, after checking names, dtypes, shapes and constant values."""
    if graph.sparse_initializer:
        _fail("graph has sparse initializers; only dense ones are supported")
    actual = {tensor.name: tensor for tensor in graph.initializer}
    if len(actual) != len(graph.initializer):
        _fail("graph has two initializers with the same name")
    constants = layout.constant_initializers(data)
    expected = {name: (onnx.TensorProto.FLOAT, shape) for name, shape in layout.parameter_shapes(data).items()}
    expected.update({name: (onnx.helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for name, v in constants.items()})
    missing = [name for name in expected if name not in actual]
    if missing:
        _fail(f"initializers {missing} are missing")
    unexpected = [name for name in actual if name not in expected]
    if unexpected:
        _fail(f"unexpected initializers {unexpected}")
    arrays = {}
    for name, (dtype, shape) in expected.items():
        tensor = actual[name]
        if tensor.data_type != dtype:
            found, wanted = (onnx.TensorProto.DataType.Name(t) for t in (tensor.data_type, dtype))
            _fail(f"initializer '{name}' has dtype {found}, expected {wanted}")
        if tuple(tensor.dims) != tuple(shape):
            _fail(f"initializer '{name}' has shape {list(tensor.dims)}, expected {list(shape)}")
        arrays[name] = numpy_helper.to_array(tensor)
        if name in constants and not np.array_equal(arrays[name], constants[name]):
            _fail(f"initializer '{name}' holds {arrays[name].tolist()}, expected {constants[name].tolist()}")
    return arrays


def _check_ops(graph: onnx.GraphProto, data: pf.PolicyData) -> None:
    allowed = {node.op_type for node in layout.graph_nodes(data)}
    for index, node in enumerate(graph.node):
        if node.domain not in ("", "ai.onnx") or node.op_type not in allowed:
            domain = f"{node.domain}::" if node.domain else ""
            _fail(f"node {index} '{node.name}': op {domain}{node.op_type} is not part of the supported pattern "
                  f"(ops used: {sorted(allowed)})")


def _check_wiring(graph: onnx.GraphProto, data: pf.PolicyData) -> None:
    """Node by node: the pattern's op, attributes and inputs, in the pattern's order."""
    expected = layout.graph_nodes(data)
    if len(graph.node) != len(expected):
        _fail(f"graph has {len(graph.node)} nodes, the pattern for {len(data.hidden)} hidden layers with "
              f"{data.activation} has {len(expected)}: {[node.op_type for node in expected]}")
    # actual tensor name -> pattern tensor name; graph inputs and initializers must keep theirs
    names = {name: name for name in [*(v.name for v in graph.input), *(t.name for t in graph.initializer)]}
    for index, (node, pattern) in enumerate(zip(graph.node, expected)):
        where = f"node {index} '{node.name}' ({node.op_type})"
        if node.op_type != pattern.op_type:
            _fail(f"{where}: expected op {pattern.op_type} here (pattern: {[n.op_type for n in expected]})")
        attributes = sorted(onnx.helper.printable_attribute(a) for a in node.attribute)
        expected_attributes = sorted(onnx.helper.printable_attribute(a) for a in pattern.attribute)
        if attributes != expected_attributes:
            _fail(f"{where}: attributes {attributes}, expected {expected_attributes}")
        inputs = [names.get(name, f"<undefined {name}>") for name in node.input]
        if inputs != list(pattern.input):
            _fail(f"{where}: inputs {list(node.input)} are wired as {inputs}, expected {list(pattern.input)}")
        if len(node.output) != len(pattern.output):
            _fail(f"{where}: has {len(node.output)} outputs, expected {len(pattern.output)}")
        for name, pattern_name in zip(node.output, pattern.output):
            if name in names:
                _fail(f"{where}: output '{name}' is already defined")
            names[name] = pattern_name
    if names.get("scores") != "scores":
        _fail("graph output 'scores' is not produced by the final Squeeze of the pattern")


def onnx_to_policy(model: onnx.ModelProto) -> pf.PolicyData:
    """The PolicyData of a graph of the supported pattern; ValueError naming the first difference otherwise."""
    if not isinstance(model, onnx.ModelProto):
        _fail(f"expected an onnx.ModelProto, got {type(model).__name__}")
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as e:
        _fail(f"not a valid ONNX model: {e}")
    _check_opset(model)
    data = _policy_skeleton(model)
    graph = model.graph
    _check_values("input", graph.input, layout.graph_inputs(data))
    _check_values("output", graph.output, layout.graph_outputs(data))
    _check_ops(graph, data)
    arrays = _initializer_arrays(graph, data)
    _check_wiring(graph, data)

    # f16 policies: the f32 initializers are rounded to f16 here, which is exact when they came from the exporter.
    value_dtype = np.float16 if data.weight_dtype == "f16" else np.float32
    for s, layer in enumerate(layout.scored_layers(data)):
        for head in range(data.n_head_kv):
            dense = range(len(data.hidden) + 1)
            data.agents[layer, head] = pf.Agent(
                shift=arrays["shift"][s, head, 0],
                scale=arrays["scale"][s, head, 0],
                weights=[arrays[f"dense{j}.weight"][s, head].T.astype(value_dtype) for j in dense],
                biases=[arrays[f"dense{j}.bias"][s, head, 0].astype(value_dtype) for j in dense],
            )
    return data


def _load(source) -> onnx.ModelProto:
    if isinstance(source, onnx.ModelProto):
        return source
    try:
        return onnx.load(os.fspath(source))
    except DecodeError as e:
        _fail(f"'{source}' is not an ONNX model: {e}")


def convert(source) -> bytes:
    """kvp.bin bytes of an ONNX policy graph given as a path or an onnx.ModelProto."""
    return pf.encode_policy(onnx_to_policy(_load(source)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.onnx_to_kvp", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="input .onnx")
    parser.add_argument("-o", "--output", required=True, help="output kvp.bin")
    args = parser.parse_args(argv)
    try:
        blob = convert(args.model)
    except (OSError, ValueError) as e:
        print(f"onnx_to_kvp: {e}", file=sys.stderr)
        return 1
    with open(args.output, "wb") as f:
        f.write(blob)
    return 0


if __name__ == "__main__":
    sys.exit(main())
