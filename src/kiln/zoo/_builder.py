"""A small graph builder shared by the zoo architectures.

It adds seeded initializers, nodes with unique readable names, and the building blocks the
models share (Linear as MatMul + Add, LayerNormalization, Conv + BatchNormalization + activation,
the two GELU forms), in the shapes ``torch.onnx.export(..., dynamo=False, opset_version=17)``
produces, so that fusion rules written for exported models match.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

import kiln

OPSET = 17
IR_VERSION = 8  # the IR version that goes with opset 17

Shape = Sequence[int | str]


class GraphBuilder:
    """Accumulates one ONNX graph; every random tensor comes from one seeded generator."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        # Built in place: copying hundreds of megabytes of weights between protos is slow.
        self.proto = onnx.ModelProto()
        self.graph = self.proto.graph
        self._names: set[str] = set()  # node and tensor names already taken
        self._consts: dict[tuple[str, tuple[int, ...], bytes], str] = {}

    # ----------------------------------------------------------------- names and tensors
    def _claim(self, name: str) -> str:
        if name in self._names:
            raise ValueError(f"duplicate name in zoo graph: {name}")
        self._names.add(name)
        return name

    def input(self, name: str, elem_type: int, shape: Shape) -> str:
        self.graph.input.append(helper.make_tensor_value_info(self._claim(name), elem_type, shape))
        return name

    def output(self, name: str, elem_type: int, shape: Shape) -> None:
        """Declare ``name`` (an existing tensor) a graph output."""
        self.graph.output.append(helper.make_tensor_value_info(name, elem_type, shape))

    def weight(self, name: str, array: np.ndarray) -> str:
        arr = np.asarray(array, order="C")
        tensor = self.graph.initializer.add()  # filled in place: no copy of the proto
        tensor.name = self._claim(name)
        tensor.data_type = helper.np_dtype_to_tensor_dtype(arr.dtype)
        tensor.dims.extend(arr.shape)
        tensor.raw_data = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
        return name

    def normal(self, name: str, shape: Sequence[int], std: float) -> str:
        arr = self.rng.standard_normal(tuple(shape), dtype=np.float32)
        arr *= np.float32(std)
        return self.weight(name, arr)

    def uniform(self, name: str, shape: Sequence[int], low: float, high: float) -> str:
        return self.weight(name, self.rng.uniform(low, high, tuple(shape)).astype(np.float32))

    def const(self, name: str, value: np.ndarray | float | int | Sequence[int]) -> str:
        """A constant initializer; identical constants are shared (the first name wins).

        Python floats become float32 scalars, ints and int lists become int64.
        """
        if isinstance(value, float):
            arr = np.array(value, dtype=np.float32)
        elif isinstance(value, int):
            arr = np.array(value, dtype=np.int64)
        elif isinstance(value, np.ndarray):
            arr = value
        else:
            arr = np.array(list(value), dtype=np.int64)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            self._consts[key] = self.weight(name, arr)
        return self._consts[key]

    def op(
        self,
        op_type: str,
        inputs: Sequence[str],
        name: str,
        output: str | None = None,
        **attrs: object,
    ) -> str:
        """Add a one-output node named ``name``; its output tensor is ``output`` or ``name``."""
        out = self._claim(output or name)
        if out != name:
            self._claim(name)
        self.graph.node.append(helper.make_node(op_type, list(inputs), [out], name=name, **attrs))
        return out

    def op_multi(
        self, op_type: str, inputs: Sequence[str], name: str, n: int, **attrs: object
    ) -> list[str]:
        outs = [self._claim(f"{name}_{i}") for i in range(n)]
        self.graph.node.append(
            helper.make_node(op_type, list(inputs), outs, name=self._claim(name), **attrs)
        )
        return outs

    # ----------------------------------------------------------------- transformer blocks
    def linear(
        self, x: str, name: str, d_in: int, d_out: int, std: float = 0.02, output: str | None = None
    ) -> str:
        """``nn.Linear`` as exported: MatMul(x, W[in, out]) then Add(bias)."""
        w = self.normal(f"{name}.weight", (d_in, d_out), std)
        b = self.normal(f"{name}.bias", (d_out,), std)
        y = self.op("MatMul", [x, w], f"{name}.MatMul")
        return self.op("Add", [y, b], f"{name}.Add", output=output)

    def layer_norm(self, x: str, name: str, dim: int, eps: float, output: str | None = None) -> str:
        """LayerNormalization (opset 17) over the last axis, gamma 1 and beta 0."""
        gamma = self.weight(f"{name}.weight", np.ones(dim, np.float32))
        beta = self.weight(f"{name}.bias", np.zeros(dim, np.float32))
        return self.op(
            "LayerNormalization",
            [x, gamma, beta],
            f"{name}.LayerNormalization",
            output=output,
            axis=-1,
            epsilon=eps,
        )

    def gelu_erf(self, x: str, name: str) -> str:
        """Exact GELU as exported at opset 17: x * (1 + Erf(x / sqrt 2)) * 0.5."""
        d = self.op("Div", [x, self.const("const.sqrt2", math.sqrt(2.0))], f"{name}.Div")
        e = self.op("Erf", [d], f"{name}.Erf")
        a = self.op("Add", [e, self.const("const.one", 1.0)], f"{name}.Add")
        m = self.op("Mul", [x, a], f"{name}.Mul")
        return self.op("Mul", [m, self.const("const.half", 0.5)], f"{name}.Mul_1")

    def gelu_tanh(self, x: str, name: str) -> str:
        """HF NewGELU, x * (0.5 * (1 + Tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))), in the operand
        order of onnxscript's ``GeluTanhFusion`` pattern."""
        p = self.op("Pow", [x, self.const("const.three", 3.0)], f"{name}.Pow")
        m = self.op("Mul", [self.const("const.gelu_coef", 0.044715), p], f"{name}.Mul")
        a = self.op("Add", [x, m], f"{name}.Add")
        s = self.op(
            "Mul",
            [self.const("const.sqrt_2_over_pi", math.sqrt(2.0 / math.pi)), a],
            f"{name}.Mul_1",
        )
        t = self.op("Tanh", [s], f"{name}.Tanh")
        t1 = self.op("Add", [t, self.const("const.one", 1.0)], f"{name}.Add_1")
        h = self.op("Mul", [self.const("const.half", 0.5), t1], f"{name}.Mul_2")
        return self.op("Mul", [x, h], f"{name}.Mul_3")

    def attention_core(
        self,
        q: str,
        k: str,
        v: str,
        name: str,
        heads: int,
        head_dim: int,
        mask: str | None,
        causal: str | None = None,
    ) -> str:
        """Multi-head attention after the Q/K/V projections, as HF BERT/GPT-2 export it.

        q, k, v: [b, s, heads*head_dim]. ``mask`` is an additive mask broadcastable to
        [b, heads, s, s]; ``causal`` a bool [1, 1, s, s] keep-mask applied with Where first.
        Returns the merged context [b, s, heads*head_dim].
        """
        split = self.const(f"const.shape_0_0_{heads}_{head_dim}", [0, 0, heads, head_dim])
        merge = self.const(f"const.shape_0_0_{heads * head_dim}", [0, 0, heads * head_dim])
        qr = self.op("Reshape", [q, split], f"{name}.query.Reshape")
        kr = self.op("Reshape", [k, split], f"{name}.key.Reshape")
        vr = self.op("Reshape", [v, split], f"{name}.value.Reshape")
        qt = self.op("Transpose", [qr], f"{name}.query.Transpose", perm=[0, 2, 1, 3])
        kt = self.op("Transpose", [kr], f"{name}.key.Transpose", perm=[0, 2, 3, 1])
        vt = self.op("Transpose", [vr], f"{name}.value.Transpose", perm=[0, 2, 1, 3])
        scores = self.op("MatMul", [qt, kt], f"{name}.scores.MatMul")
        scale = self.const(f"const.sqrt_head_dim_{head_dim}", float(math.sqrt(head_dim)))
        scores = self.op("Div", [scores, scale], f"{name}.scores.Div")
        if causal is not None:
            fill = self.const("const.masked_bias", -10000.0)
            scores = self.op("Where", [causal, scores, fill], f"{name}.causal.Where")
        if mask is not None:
            scores = self.op("Add", [scores, mask], f"{name}.mask.Add")
        probs = self.op("Softmax", [scores], f"{name}.Softmax", axis=-1)
        ctx = self.op("MatMul", [probs, vt], f"{name}.context.MatMul")
        ctx = self.op("Transpose", [ctx], f"{name}.context.Transpose", perm=[0, 2, 1, 3])
        return self.op("Reshape", [ctx, merge], f"{name}.context.Reshape")

    def padding_mask(self, attention_mask: str, name: str) -> str:
        """HF extended mask [b,1,1,s]: (1 - Cast(mask[:, None, None, :])) * -10000.

        Two Unsqueeze nodes, as the export of ``mask[:, None, None, :]`` has them.
        """
        u = self.op(
            "Unsqueeze", [attention_mask, self.const("const.axes_1", [1])], f"{name}.Unsqueeze"
        )
        u = self.op("Unsqueeze", [u, self.const("const.axes_2", [2])], f"{name}.Unsqueeze_1")
        c = self.op("Cast", [u], f"{name}.Cast", to=TensorProto.FLOAT)
        s = self.op("Sub", [self.const("const.one", 1.0), c], f"{name}.Sub")
        return self.op("Mul", [s, self.const("const.mask_fill", -10000.0)], f"{name}.Mul")

    # ----------------------------------------------------------------- convolution blocks
    def conv(
        self,
        x: str,
        name: str,
        cin: int,
        cout: int,
        k: int,
        stride: int = 1,
        pad: int = 0,
        group: int = 1,
        bias: bool = False,
        nd: int = 2,
        std: float | None = None,
        output: str | None = None,
    ) -> str:
        """Conv with He-normal (fan-in) weights; ``nd`` spatial dims (2 or 3)."""
        fan_in = cin // group * k**nd
        w = self.normal(
            f"{name}.weight",
            (cout, cin // group) + (k,) * nd,
            std if std is not None else math.sqrt(2.0 / fan_in),
        )
        ins = [x, w]
        if bias:
            ins.append(self.normal(f"{name}.bias", (cout,), 0.02))
        return self.op(
            "Conv",
            ins,
            name,
            output=output,
            kernel_shape=[k] * nd,
            strides=[stride] * nd,
            pads=[pad] * (2 * nd),
            group=group,
            dilations=[1] * nd,
        )

    def batch_norm(self, x: str, name: str, c: int, gamma: float = 1.0) -> str:
        """Inference BatchNormalization with plausible trained-looking statistics."""
        ins = [
            x,
            self.weight(
                f"{name}.weight", (gamma * self.rng.uniform(0.8, 1.2, c)).astype(np.float32)
            ),
            self.normal(f"{name}.bias", (c,), 0.05),
            self.normal(f"{name}.running_mean", (c,), 0.05),
            self.uniform(f"{name}.running_var", (c,), 0.8, 1.2),
        ]
        return self.op("BatchNormalization", ins, name, epsilon=1e-5, momentum=0.9)

    def conv_bn(
        self,
        x: str,
        conv_name: str,
        bn_name: str,
        cin: int,
        cout: int,
        k: int,
        stride: int = 1,
        group: int = 1,
        act: str | None = "Relu",
        nd: int = 2,
        gamma: float = 1.0,
    ) -> str:
        """Conv (no bias, 'same' padding) + BatchNormalization + optional Relu/ReLU6."""
        y = self.conv(x, conv_name, cin, cout, k, stride, k // 2, group, nd=nd)
        y = self.batch_norm(y, bn_name, cout, gamma)
        if act == "Relu":
            return self.op("Relu", [y], f"{bn_name}.Relu")
        if act == "Relu6":
            lo, hi = self.const("const.zero", 0.0), self.const("const.six", 6.0)
            return self.op("Clip", [y, lo, hi], f"{bn_name}.Clip")
        return y

    # ----------------------------------------------------------------- model
    def model(self, zoo_name: str, dims: dict[str, int]) -> onnx.ModelProto:
        """The finished model; the builder must not be used afterwards."""
        m = self.proto
        m.graph.name = zoo_name.replace("-", "_")
        m.ir_version = IR_VERSION
        m.opset_import.append(helper.make_opsetid("", OPSET))
        m.producer_name = "kiln.zoo"
        m.producer_version = kiln.__version__
        helper.set_model_props(m, {"kiln.zoo": zoo_name, "kiln.dims": json.dumps(dims)})
        return m
