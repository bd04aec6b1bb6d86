"""Export a kvp.bin policy to one ONNX graph for the whole policy (contract: docs/onnx.md).

The graph layout is defined here once: `policy_to_onnx` builds it from a PolicyData, and training.onnx_to_kvp
rebuilds the expected layout from the graph's own metadata with the same functions to verify a graph before
converting it back.

    python -m training.export_onnx policy.kvp.bin -o policy.onnx
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kvp_cpp import policy_file as pf

__all__ = [
    "OPSET",
    "IR_VERSION",
    "CONTRACT_VERSION",
    "HEADER_KEY",
    "METADATA_KEY",
    "RECENCY_KEY",
    "TOKEN_DIM",
    "header_fields",
    "scored_layers",
    "graph_inputs",
    "graph_outputs",
    "graph_nodes",
    "constant_initializers",
    "parameter_shapes",
    "policy_to_onnx",
    "export_onnx",
]

# Opset 17 has every op the graph uses with its current semantics (Squeeze takes axes as an input since 13); 18
# only changes ops the graph does not use, and 17 is what more runtimes and torch.onnx exporters support.
OPSET = 17
IR_VERSION = 8  # the IR version that introduced opset 17; newer ones would lock out older runtimes
CONTRACT_VERSION = 1
HEADER_KEY = "kvp.header"
METADATA_KEY = "kvp.metadata"
# A kvp.bin's recency terms are added when the evictor ranks, from each token's age at that moment, so they are not
# part of the scoring graph; they travel beside it: {"knots": K, "values": [S][H][K]}, absent without them.
RECENCY_KEY = "kvp.recency"
TOKEN_DIM = "n_tokens"

# Scalars of the GELU (tanh form) subgraph: 0.5 · x · (1 + tanh(sqrt(2/π) · (x + 0.044715 · x³))).
_GELU_CONSTANTS = {
    "gelu.cubic": 0.044715,
    "gelu.sqrt_2_over_pi": math.sqrt(2.0 / math.pi),
    "gelu.one": 1.0,
    "gelu.half": 0.5,
}
SQUEEZE_AXES = "squeeze_axes"
EXPAND_SHAPE = "pos_features_expand_shape"


def header_fields(data: pf.PolicyData) -> dict:
    """The kvp.bin header fields, position features and layer flags: the JSON stored under HEADER_KEY."""
    return {
        "contract_version": CONTRACT_VERSION,
        **data.identity(),
        "pos_features": [{"kind": pf.POS_FEATURE_KINDS[kind], "a": float(a)} for kind, a in data.pos_features],
        "hidden": [int(width) for width in data.hidden],
        "activation": data.activation,
        "weight_dtype": data.weight_dtype,
        "n_sink": data.n_sink,
        "n_recent": data.n_recent,
        "layer_scored": [bool(scored) for scored in data.layer_scored],
    }


def scored_layers(data: pf.PolicyData) -> list:
    """Indices of the layers with agents: the order of the graph's leading (layer) axis."""
    return [layer for layer, scored in enumerate(data.layer_scored) if scored]


def _widths(data: pf.PolicyData) -> list:
    return [data.input_dim, *data.hidden, 1]


def graph_inputs(data: pf.PolicyData) -> list:
    n_scored, heads = len(scored_layers(data)), data.n_head_kv
    return [
        helper.make_tensor_value_info("k", TensorProto.FLOAT, [n_scored, heads, TOKEN_DIM, data.head_dim_k]),
        helper.make_tensor_value_info("v", TensorProto.FLOAT, [n_scored, heads, TOKEN_DIM, data.head_dim_v]),
        helper.make_tensor_value_info("pos_features", TensorProto.FLOAT, [TOKEN_DIM, len(data.pos_features)]),
    ]


def graph_outputs(data: pf.PolicyData) -> list:
    shape = [len(scored_layers(data)), data.n_head_kv, TOKEN_DIM]
    return [helper.make_tensor_value_info("scores", TensorProto.FLOAT, shape)]


def parameter_shapes(data: pf.PolicyData) -> dict:
    """Name -> shape of the float32 initializers that hold the policy's numbers, agents stacked on the first two axes.
    Weights are (n_in, n_out), the transpose of kvp.bin's (n_out, n_in) rows, so that MatMul takes them as they are."""
    stack = (len(scored_layers(data)), data.n_head_kv)
    widths = _widths(data)
    shapes = {"shift": (*stack, 1, data.input_dim), "scale": (*stack, 1, data.input_dim)}
    for j in range(len(widths) - 1):
        shapes[f"dense{j}.weight"] = (*stack, widths[j], widths[j + 1])
        shapes[f"dense{j}.bias"] = (*stack, 1, widths[j + 1])
    return shapes


def constant_initializers(data: pf.PolicyData) -> dict:
    """Name -> value of the initializers fixed by the layout (shapes, axes, activation constants)."""
    constants = {
        EXPAND_SHAPE: np.array([len(scored_layers(data)), data.n_head_kv, 1, 1], dtype=np.int64),
        SQUEEZE_AXES: np.array([3], dtype=np.int64),
    }
    if data.activation == "gelu_tanh" and data.hidden:
        constants.update({name: np.array(value, dtype=np.float32) for name, value in _GELU_CONSTANTS.items()})
    return constants


def _activation_nodes(activation: str, x: str, prefix: str) -> tuple:
    """Nodes computing activation(x) from primitive ops, and the name of their output."""
    y = f"{prefix}.{activation}"
    if activation == "relu":
        return [helper.make_node("Relu", [x], [y])], y
    if activation == "tanh":
        return [helper.make_node("Tanh", [x], [y])], y
    if activation == "silu":
        sigmoid = f"{prefix}.sigmoid"
        return [helper.make_node("Sigmoid", [x], [sigmoid]), helper.make_node("Mul", [x, sigmoid], [y])], y
    if activation == "gelu_tanh":
        n = lambda step: f"{prefix}.gelu.{step}"  # noqa: E731
        return [
            helper.make_node("Mul", [x, x], [n("x2")]),
            helper.make_node("Mul", [n("x2"), x], [n("x3")]),
            helper.make_node("Mul", [n("x3"), "gelu.cubic"], [n("cubic")]),
            helper.make_node("Add", [x, n("cubic")], [n("inner")]),
            helper.make_node("Mul", [n("inner"), "gelu.sqrt_2_over_pi"], [n("scaled")]),
            helper.make_node("Tanh", [n("scaled")], [n("tanh")]),
            helper.make_node("Add", [n("tanh"), "gelu.one"], [n("gate")]),
            helper.make_node("Mul", [x, n("gate")], [n("gated")]),
            helper.make_node("Mul", [n("gated"), "gelu.half"], [y]),
        ], y
    raise ValueError(f"activation {activation!r} is not one of {pf.ACTIVATIONS}")


def graph_nodes(data: pf.PolicyData) -> list:
    """Expand → Concat → Sub → Mul → (MatMul → Add → activation)* → MatMul → Add → Squeeze."""
    nodes = [
        helper.make_node("Expand", ["pos_features", EXPAND_SHAPE], ["pos_features_expanded"]),
        helper.make_node("Concat", ["k", "v", "pos_features_expanded"], ["mlp_input"], axis=3),
        helper.make_node("Sub", ["mlp_input", "shift"], ["centered"]),
        helper.make_node("Mul", ["centered", "scale"], ["normalized"]),
    ]
    x = "normalized"
    n_dense = len(data.hidden) + 1
    for j in range(n_dense):
        nodes.append(helper.make_node("MatMul", [x, f"dense{j}.weight"], [f"dense{j}.matmul"]))
        nodes.append(helper.make_node("Add", [f"dense{j}.matmul", f"dense{j}.bias"], [f"dense{j}.out"]))
        x = f"dense{j}.out"
        if j + 1 < n_dense:
            activation, x = _activation_nodes(data.activation, x, f"dense{j}")
            nodes.extend(activation)
    nodes.append(helper.make_node("Squeeze", [x, SQUEEZE_AXES], ["scores"]))
    for index, node in enumerate(nodes):
        node.name = f"{index:03d}.{node.op_type}"
    return nodes


def _stacked_parameters(data: pf.PolicyData) -> dict:
    """Name -> float32 array of parameter_shapes(data); f16 weights become the f32 values they represent exactly."""
    layers = scored_layers(data)
    heads = range(data.n_head_kv)
    agents = [[data.agents[layer, head] for head in heads] for layer in layers]

    def stack(values_of) -> np.ndarray:
        return np.array([[values_of(agent) for agent in row] for row in agents], dtype=np.float32)

    arrays = {"shift": stack(lambda a: a.shift[None, :]), "scale": stack(lambda a: a.scale[None, :])}
    for j in range(len(data.hidden) + 1):
        arrays[f"dense{j}.weight"] = stack(lambda a: np.asarray(a.weights[j]).T)
        arrays[f"dense{j}.bias"] = stack(lambda a: np.asarray(a.biases[j])[None, :])
    return arrays


def policy_to_onnx(data: pf.PolicyData) -> onnx.ModelProto:
    """One ONNX graph (opset 17) scoring every scored layer and KV head of `data` at once."""
    pf.encode_policy(data)  # the format's own checks: an exportable policy is a writable one
    parameters = _stacked_parameters(data)
    expected = parameter_shapes(data)
    assert {name: array.shape for name, array in parameters.items()} == expected
    initializers = [numpy_helper.from_array(array, name) for name, array in parameters.items()]
    initializers += [numpy_helper.from_array(value, name) for name, value in constant_initializers(data).items()]
    graph = helper.make_graph(
        graph_nodes(data), "kvp_policy", graph_inputs(data), graph_outputs(data), initializer=initializers
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        ir_version=IR_VERSION,
        producer_name="kvp-cpp",
        doc_string="KV Policy eviction scorer; contract in kvp-cpp docs/onnx.md",
    )
    props = {
        HEADER_KEY: json.dumps(header_fields(data), ensure_ascii=False),
        METADATA_KEY: json.dumps(data.metadata, ensure_ascii=False, allow_nan=False),
    }
    if data.recency:
        values = [[[float(x) for x in data.recency[layer, head]] for head in range(data.n_head_kv)]
                  for layer in scored_layers(data)]  # fmt: skip
        props[RECENCY_KEY] = json.dumps({"knots": data.n_recency_knots, "values": values})
    helper.set_model_props(model, props)
    return model


def export_onnx(data: pf.PolicyData, path) -> onnx.ModelProto:
    model = policy_to_onnx(data)
    onnx.save(model, path)
    return model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.export_onnx", description=__doc__.splitlines()[0])
    parser.add_argument("policy", help="input kvp.bin")
    parser.add_argument("-o", "--output", required=True, help="output .onnx")
    args = parser.parse_args(argv)
    try:
        export_onnx(pf.read_policy(args.policy), args.output)
    except ValueError as e:
        print(f"export_onnx: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
