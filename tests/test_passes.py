"""Single passes on small hand-made graphs: each keeps the outputs and does its one job."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common
from onnx import TensorProto
from onnx import helper as h
from onnx import numpy_helper as nh
from onnxscript.rewriter import pattern

import kiln
from kiln import zoo
from kiln.backends import get_backend
from kiln.backends.ort import OrtOptions
from kiln.ir import stamp_origins
from kiln.passes import KilnPass, default_pipeline, run_pipeline
from kiln.passes.canonical_mask import CanonicalMaskPass
from kiln.passes.fusions import FUSIONS, FusionPass
from kiln.passes.noop_reshapes import NoopReshapesPass
from kiln.passes.prune_rows import PruneRowsPass
from kiln.passes.refine_shapes import RefineShapesPass
from kiln.passes.shape_reads import ShapeReadsPass
from kiln.passes.simplify import SimplifyPass

RNG = np.random.default_rng(0)


def run(model: ir.Model | onnx.ModelProto, feeds):
    if isinstance(model, onnx.ModelProto):
        model = ir.serde.deserialize_model(model)
    return get_backend("ort").compile(model, OrtOptions("basic")).run(feeds)


def weight(name: str, *shape: int) -> onnx.TensorProto:
    return nh.from_array(RNG.normal(0, 0.5, shape).astype(np.float32), name)


def classifier_head() -> onnx.ModelProto:
    """x → MatMul → Add → Relu → LayerNorm → Gather(token 0) → MatMul: a ViT-style head."""
    nodes = [
        h.make_node("MatMul", ["x", "w1"], ["m"], name="mm"),
        h.make_node("Add", ["m", "b1"], ["a"], name="add"),
        h.make_node("Relu", ["a"], ["r"], name="relu"),
        h.make_node("Add", ["r", "x"], ["res"], name="residual"),
        h.make_node("LayerNormalization", ["res", "g", "beta"], ["ln"], name="ln", axis=-1),
        h.make_node("Gather", ["ln", "zero"], ["cls"], name="cls", axis=1),
        h.make_node("MatMul", ["cls", "w2"], ["y"], name="head"),
    ]
    inits = [
        weight("w1", 8, 8),
        weight("b1", 8),
        weight("g", 8),
        weight("beta", 8),
        weight("w2", 8, 3),
        nh.from_array(np.array(0, np.int64), "zero"),
    ]
    graph = h.make_graph(
        nodes,
        "head",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 5, 8])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        inits,
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


def test_prune_rows_computes_only_the_kept_token():
    proto = classifier_head()
    model = ir.serde.deserialize_model(proto)
    stamp_origins(model)
    moved = PruneRowsPass()(model)
    assert moved.modified
    first = next(iter(model.graph))
    assert first.op_type == "Gather" and first.inputs[0].name == "x", "Gather must reach x"
    x = RNG.normal(size=(2, 5, 8)).astype(np.float32)
    np.testing.assert_allclose(run(model, {"x": x})[0], run(proto, {"x": x})[0], rtol=1e-5)


def test_prune_rows_stops_at_an_op_that_mixes_rows():
    proto = classifier_head()
    for node in proto.graph.node:
        if node.name == "ln":
            node.attribute[0].i = 1  # normalising over rows too: the Gather must stay below
    model = ir.serde.deserialize_model(proto)
    PruneRowsPass()(model)
    ln = next(n for n in model.graph if n.op_type == "LayerNormalization")
    assert ln.inputs[0].producer().op_type == "Add"
    x = RNG.normal(size=(1, 5, 8)).astype(np.float32)
    np.testing.assert_allclose(run(model, {"x": x})[0], run(proto, {"x": x})[0], rtol=1e-5)


def masked_scores(bias_nodes: list[onnx.NodeProto], inits) -> onnx.ModelProto:
    nodes = [
        *bias_nodes,
        h.make_node("Add", ["scores", "bias"], ["s"], name="add_bias"),
        h.make_node("Softmax", ["s"], ["p"], name="softmax", axis=-1),
    ]
    graph = h.make_graph(
        nodes,
        "attn",
        [
            h.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", 2, "seq", "seq"]),
            h.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"]),
        ],
        [h.make_tensor_value_info("p", TensorProto.FLOAT, ["batch", 2, "seq", "seq"])],
        inits,
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


def test_canonical_mask_rewrites_an_exotic_mask_and_keeps_outputs():
    # bias = Where(mask_bool, 0, -inf), the transformers-5 style.
    inits = [
        nh.from_array(np.array([1, 2], np.int64), "axes"),
        nh.from_array(np.array(0.0, np.float32), "zero_f"),
        nh.from_array(np.array(-np.inf, np.float32), "neg_inf"),
    ]
    nodes = [
        h.make_node("Unsqueeze", ["attention_mask", "axes"], ["u"], name="u"),
        h.make_node("Cast", ["u"], ["keep"], name="cast", to=TensorProto.BOOL),
        h.make_node("Where", ["keep", "zero_f", "neg_inf"], ["bias"], name="where"),
    ]
    proto = masked_scores(nodes, inits)
    model = ir.serde.deserialize_model(proto)
    assert CanonicalMaskPass().apply(model) == 1
    ops = [n.op_type for n in model.graph]
    assert "Where" not in [n.op_type for n in model.graph if n.outputs[0].uses()]
    assert ops.count("Sub") == 1 and ops.count("Mul") == 1
    scores = RNG.normal(size=(2, 2, 6, 6)).astype(np.float32)
    mask = np.ones((2, 6), np.int64)
    mask[1, 4:] = 0
    feeds = {"scores": scores, "attention_mask": mask}
    np.testing.assert_allclose(run(model, feeds)[0], run(proto, feeds)[0], atol=1e-6)


def test_canonical_mask_leaves_a_bias_that_is_not_a_padding_mask():
    # bias = mask * 5: not zero where kept, so it must not be rewritten.
    inits = [
        nh.from_array(np.array([1, 2], np.int64), "axes"),
        nh.from_array(np.array(5.0, np.float32), "five"),
    ]
    nodes = [
        h.make_node("Unsqueeze", ["attention_mask", "axes"], ["u"], name="u"),
        h.make_node("Cast", ["u"], ["f"], name="cast", to=TensorProto.FLOAT),
        h.make_node("Mul", ["f", "five"], ["bias"], name="scale"),
    ]
    model = ir.serde.deserialize_model(masked_scores(nodes, inits))
    assert CanonicalMaskPass().apply(model) == 0


def test_written_out_layernorm_and_conv_relu_fuse_and_match(tmp_path):
    import collections

    import kiln

    d = 8
    nodes = [
        h.make_node("Conv", ["x", "w", "cb"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        h.make_node("Relu", ["c"], ["r"], name="relu"),
        h.make_node("Transpose", ["r"], ["t"], name="nhwc", perm=[0, 2, 3, 1]),
        h.make_node("ReduceMean", ["t", "axes"], ["mean"], name="mean", keepdims=1),
        h.make_node("Sub", ["t", "mean"], ["dev"], name="sub"),
        h.make_node("Pow", ["dev", "two"], ["sq"], name="pow"),
        h.make_node("ReduceMean", ["sq", "axes"], ["var"], name="var", keepdims=1),
        h.make_node("Add", ["var", "eps"], ["ve"], name="add_eps"),
        h.make_node("Sqrt", ["ve"], ["std"], name="sqrt"),
        h.make_node("Div", ["dev", "std"], ["norm"], name="div"),
        h.make_node("Mul", ["norm", "gamma"], ["scaled"], name="scale"),
        h.make_node("Add", ["scaled", "beta"], ["y"], name="shift"),
    ]
    inits = [
        weight("w", d, 3, 3, 3),
        weight("cb", d),
        weight("gamma", d),
        weight("beta", d),
        nh.from_array(np.array([-1], np.int64), "axes"),
        nh.from_array(np.array(2.0, np.float32), "two"),
        nh.from_array(np.array(1e-5, np.float32), "eps"),
    ]
    graph = h.make_graph(
        nodes,
        "ln",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 5, 5])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 5, 5, d])],
        inits,
    )
    path = tmp_path / "ln.onnx"
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 18)]), str(path))
    artifact = kiln.compile(path, tmp_path / "ln.kiln", rounds=0)
    assert artifact.manifest.verification.ok
    written = collections.Counter(n.op_type for n in nodes)
    counts = collections.Counter(n.op_type for n in onnx.load(str(artifact.model_path)).graph.node)
    assert counts["LayerNormalization"] == written["Sqrt"] and counts["ReduceMean"] == 0, counts
    assert counts["FusedConv"] == written["Conv"] and counts["Relu"] == 0, counts


def two_equal_weights() -> onnx.ModelProto:
    """y = (x + w1) · w2 with w1 and w2 equal: deduplication rewires one reader in place."""
    w = RNG.normal(size=8).astype(np.float32)
    nodes = [
        h.make_node("Add", ["x", "w1"], ["a"], name="add"),
        h.make_node("Mul", ["a", "w2"], ["y"], name="mul"),
    ]
    graph = h.make_graph(
        nodes,
        "dedup",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        [nh.from_array(w, "w1"), nh.from_array(w.copy(), "w2")],
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


def test_a_rewrite_that_keeps_the_node_count_is_a_modification():
    model = ir.serde.deserialize_model(two_equal_weights())
    common.ShapeInferencePass()(model)  # so that only the rewrite itself can change the model
    nodes = len(model.graph)
    simplify = SimplifyPass()
    result = simplify(model)
    assert len(model.graph) == nodes
    assert simplify.count == 1 and result.modified  # the Mul now reads w1
    assert model.graph.node(1).inputs[1] is model.graph.node(0).inputs[1]


class RenameAddUncounted(KilnPass):
    """Turns every Add into a Sub in place, and under-reports: says it rewrote nothing."""

    name = "rename-add"

    def apply(self, model: ir.Model) -> int:
        for node in model.graph:
            if node.op_type == "Add":
                node.op_type = "Sub"
        return 0


def test_modified_comes_from_the_model_not_the_count():
    model = ir.serde.deserialize_model(two_equal_weights())
    assert RenameAddUncounted()(model).modified
    assert not RenameAddUncounted()(model).modified  # no Add left: nothing changes


def test_a_pass_that_matches_nothing_is_not_a_modification():
    model = ir.serde.deserialize_model(classifier_head())
    common.ShapeInferencePass()(model)
    passes = [NoopReshapesPass(), ShapeReadsPass(), CanonicalMaskPass(), RefineShapesPass()]
    passes += [FusionPass(spec) for spec in FUSIONS if spec.name != "fuse-skip-layernorm"]
    for kiln_pass in passes:
        result = kiln_pass(model)
        assert (result.modified, kiln_pass.count) == (False, 0), kiln_pass.name


def test_a_second_pipeline_run_changes_nothing():
    """Every pass of the default pipeline, run again on its own output, reports no change."""
    model = ir.serde.deserialize_model(zoo.build("bert-tiny"))
    stamp_origins(model)
    first = run_pipeline(model, default_pipeline())
    assert sum(r.rewrites for r in first) > 0
    for spec in default_pipeline():
        kiln_pass = spec.make()
        assert not kiln_pass(model).modified, spec.name
        assert kiln_pass.count == 0, spec.name


# ---------------------------------------------------------------------------- the onnxscript fence
SRC = Path(kiln.__file__).parent
FENCE = SRC / "ir" / "onnxscript_internals.py"


def _is_private(name: str) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in name.split("."))


def _root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def private_onnxscript_uses(path: Path) -> list[str]:
    """`line: what` for every private onnxscript name a file imports or reaches through an
    imported onnxscript module (`from onnxscript.x import _y`, `onnxscript.x._y`,
    `module._y` where `module` came from onnxscript)."""
    tree = ast.parse(path.read_text(), str(path))
    aliases: set[str] = set()
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "onnxscript":
                    aliases.add(alias.asname or "onnxscript")
                    if _is_private(alias.name):
                        found.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("onnxscript"):
            for alias in node.names:
                aliases.add(alias.asname or alias.name)
                if _is_private(f"{node.module}.{alias.name}"):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr) and _root(node) in aliases:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_private_onnxscript_names_are_used_only_through_the_fence():
    assert private_onnxscript_uses(FENCE), "the checker must see what the fence itself imports"
    leaks = {
        str(path.relative_to(SRC)): uses
        for path in sorted(SRC.rglob("*.py"))
        if path != FENCE and (uses := private_onnxscript_uses(path))
    }
    assert leaks == {}, f"import these from kiln.ir.onnxscript_internals instead: {leaks}"


def test_the_fence_gives_working_symbols():
    from kiln.ir import onnxscript_internals as internals

    assert set(internals.__all__) <= set(dir(internals))
    for name in ("get_numpy_value", "FoldConstantsPass", "register_metadata_merger"):
        assert callable(getattr(internals, name)), name
    assert callable(internals.guard_split_to_sequence)
    rule_sets = [
        internals.DEFAULT_REWRITE_RULES,
        internals.FUSE_BATCHNORM_RULES,
        internals.FUSE_PAD_INTO_CONV_RULES,
        internals.MATMUL_ADD_TO_GEMM_RULES,
        internals.LAYER_NORMALIZATION_RULES,
        internals.MHA_SCALE_RULES,
        internals.SDPA_VIA_MHA_RULES,
    ]
    for rules in rule_sets:
        rules = list(rules)
        assert rules and all(isinstance(r, pattern.RewriteRule) for r in rules)
    value = ir.Value(name="c", const_value=ir.tensor(np.arange(3, dtype=np.int64)))
    np.testing.assert_array_equal(internals.get_numpy_value(value), [0, 1, 2])
    assert internals.get_numpy_value(ir.Value(name="x")) is None
    assert isinstance(internals.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT, int)


def test_the_installed_onnxscript_is_in_the_tested_range():
    from importlib.metadata import version

    from packaging.specifiers import SpecifierSet

    from kiln.ir.onnxscript_internals import TESTED_RANGE

    assert version("onnxscript") in SpecifierSet(TESTED_RANGE)
    pyproject = SRC.parent.parent / "pyproject.toml"
    if pyproject.exists():  # a source checkout: the pin and the fence say the same
        assert f'"onnxscript{TESTED_RANGE}"' in pyproject.read_text()
