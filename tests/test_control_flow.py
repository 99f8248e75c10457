"""Control flow: If/Loop bodies that end in Identity nodes (PyTorch exports) compile verified,
run like the original on both branches, and a pass that crashes or strands a body output is
dropped and named, never shown as a traceback."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnx import helper as h
from test_compile import CrashingPass  # the same buggy pass, planted in other pipelines

import kiln
from kiln.compiler import passes_stage
from kiln.passes import KilnPass, PassSpec, default_pipeline
from kiln.passes.scopes import ScopedIdentityEliminationPass, stray_outputs

F = TensorProto.FLOAT
X = np.arange(-3, 3, dtype=np.float32).reshape(2, 3)


def _check(graph: onnx.GraphProto) -> onnx.ModelProto:
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _branch(name: str, nodes: list[onnx.NodeProto], *outputs: str) -> onnx.GraphProto:
    return h.make_graph(nodes, name, [], [h.make_tensor_value_info(o, F, None) for o in outputs])


def _if_model(then_branch, else_branch, outer=(), n_out=1, extra_inputs=()) -> onnx.ModelProto:
    outputs = [f"out{i}" for i in range(n_out)]
    nodes = [*outer, h.make_node("If", ["cond"], outputs, name="if", then_branch=then_branch,
                                 else_branch=else_branch)]  # fmt: skip
    inputs = [
        h.make_tensor_value_info("cond", TensorProto.BOOL, []),
        h.make_tensor_value_info("x", F, [2, 3]),
        *extra_inputs,
    ]
    outs = [h.make_tensor_value_info(o, F, [2, 3]) for o in outputs]
    return _check(h.make_graph(nodes, "g", inputs, outs))


def if_forwarding() -> onnx.ModelProto:
    """Each branch only forwards values: a graph input, one computed outside, and the same
    outer value from both branches."""
    outer = [h.make_node("Relu", ["x"], ["a"], name="relu"), h.make_node("Neg", ["x"], ["b"])]
    then_branch = _branch(
        "then",
        [
            h.make_node("Identity", ["a"], ["t0"]),
            h.make_node("Identity", ["x"], ["t1"]),
            h.make_node("Identity", ["b"], ["t2"]),
        ],
        "t0", "t1", "t2",
    )  # fmt: skip
    else_branch = _branch(
        "else",
        [
            h.make_node("Identity", ["b"], ["e0"]),
            h.make_node("Identity", ["a"], ["e1"]),
            h.make_node("Identity", ["b"], ["e2"]),
        ],
        "e0", "e1", "e2",
    )  # fmt: skip
    return _if_model(then_branch, else_branch, outer, n_out=3)


def if_computing() -> onnx.ModelProto:
    """A branch computes, then ends in Identity; the other ends in ops the simplifier turns
    into Identity of an outer value (Mul by 1, a Cast to the same type)."""
    one = h.make_tensor("one", F, [], [1.0])
    outer = [h.make_node("Constant", [], ["one"], value=one), h.make_node("Relu", ["x"], ["a"])]
    then_branch = _branch(
        "then",
        [
            h.make_node("Add", ["x", "a"], ["s"]),
            h.make_node("Sigmoid", ["s"], ["r"]),
            h.make_node("Identity", ["r"], ["t0"]),
            h.make_node("Identity", ["a"], ["t1"]),
        ],
        "t0", "t1",
    )  # fmt: skip
    else_branch = _branch(
        "else",
        [h.make_node("Mul", ["a", "one"], ["e0"]), h.make_node("Cast", ["a"], ["e1"], to=F)],
        "e0", "e1",
    )  # fmt: skip
    return _if_model(then_branch, else_branch, outer, n_out=2)


def nested_if() -> onnx.ModelProto:
    """An If inside an If, every body ending in Identity of an outer value."""
    outer = [h.make_node("Relu", ["x"], ["a"]), h.make_node("Neg", ["x"], ["b"])]
    inner = h.make_node(
        "If", ["inner_cond"], ["inner"], name="inner_if",
        then_branch=_branch("inner_then", [h.make_node("Identity", ["a"], ["it"])], "it"),
        else_branch=_branch("inner_else", [h.make_node("Identity", ["b"], ["ie"])], "ie"),
    )  # fmt: skip
    then_branch = _branch("then", [inner, h.make_node("Identity", ["inner"], ["t0"])], "t0")
    else_branch = _branch("else", [h.make_node("Identity", ["b"], ["e0"])], "e0")
    inner_cond = h.make_tensor_value_info("inner_cond", TensorProto.BOOL, [])
    return _if_model(then_branch, else_branch, outer, extra_inputs=[inner_cond])


def loop() -> onnx.ModelProto:
    """A Loop whose body ends in Identity nodes: of its condition input, of a value it
    computes, of a loop-invariant value computed outside, and of a graph input."""
    body = h.make_graph(
        [
            h.make_node("Identity", ["cond_in"], ["cond_out"]),
            h.make_node("Add", ["acc_in", "a"], ["acc_new"]),
            h.make_node("Identity", ["acc_new"], ["acc_out"]),
            h.make_node("Identity", ["a"], ["scan_a"]),
            h.make_node("Identity", ["x"], ["scan_x"]),
        ],
        "body",
        [
            h.make_tensor_value_info("i", TensorProto.INT64, []),
            h.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            h.make_tensor_value_info("acc_in", F, [2, 3]),
        ],
        [
            h.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            h.make_tensor_value_info("acc_out", F, [2, 3]),
            h.make_tensor_value_info("scan_a", F, [2, 3]),
            h.make_tensor_value_info("scan_x", F, [2, 3]),
        ],
    )
    nodes = [
        h.make_node("Relu", ["x"], ["a"]),
        h.make_node("Loop", ["n", "cond", "x"], ["final", "as", "xs"], name="loop", body=body),
    ]
    inputs = [
        h.make_tensor_value_info("n", TensorProto.INT64, []),
        h.make_tensor_value_info("cond", TensorProto.BOOL, []),
        h.make_tensor_value_info("x", F, [2, 3]),
    ]
    outputs = [
        h.make_tensor_value_info("final", F, [2, 3]),
        h.make_tensor_value_info("as", F, ["steps", 2, 3]),
        h.make_tensor_value_info("xs", F, ["steps", 2, 3]),
    ]
    return _check(h.make_graph(nodes, "g", inputs, outputs))


def _feeds(name: str) -> list[dict[str, np.ndarray]]:
    """The condition fed both ways (for nested If: every pair of conditions)."""
    flags = [np.array(True), np.array(False)]
    if name == "loop":
        return [{"n": np.array(3, np.int64), "cond": c, "x": X} for c in flags]
    if name == "nested_if":
        return [{"cond": c, "inner_cond": i, "x": X} for c in flags for i in flags]
    return [{"cond": c, "x": X} for c in flags]


MODELS: dict[str, Callable[[], onnx.ModelProto]] = {
    "if_forwarding": if_forwarding,
    "if_computing": if_computing,
    "nested_if": nested_if,
    "loop": loop,
}


def ort_outputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def assert_runs_like_original(artifact, model: onnx.ModelProto, feeds_list) -> None:
    session = kiln.Session(artifact.path)
    for feeds in feeds_list:
        expected = ort_outputs(model, feeds)
        got = session.run(None, feeds)
        for want, have in zip(expected, got, strict=True):
            np.testing.assert_allclose(have, want, rtol=1e-6, atol=1e-6)


def assert_valid_artifact(artifact) -> None:
    compiled = onnx.load(str(artifact.model_path))
    onnx.checker.check_model(compiled, full_check=True)
    assert stray_outputs(ir.serde.deserialize_model(compiled)) == set()


def compile_quietly(path, out, **options):
    """kiln.compile, with every progress line kept to check that nothing leaked."""
    said: list[str] = []
    artifact = kiln.compile(str(path), out, progress=said.append, rounds=0, **options)
    assert not any("StopIteration" in line or "Traceback" in line for line in said), said
    return artifact, said


@pytest.mark.parametrize("name", list(MODELS))
def test_control_flow_compiles_verified_and_runs_both_branches(name, tmp_path):
    model = MODELS[name]()
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, path)
    artifact, _ = compile_quietly(path, tmp_path / "m.kiln")
    assert artifact.manifest.verification.ok
    assert artifact.manifest.dropped_passes == [], "every pass must handle control flow"
    assert_valid_artifact(artifact)
    assert_runs_like_original(artifact, model, _feeds(name))


@pytest.mark.parametrize("name", list(MODELS))
def test_cli_optimizes_control_flow(name, tmp_path):
    path = tmp_path / f"{name}.onnx"
    onnx.save(MODELS[name](), path)
    result = subprocess.run(
        [sys.executable, "-m", "kiln", "optimize", str(path), "-o", str(tmp_path / "m.kiln"),
         "--rounds", "0"],
        cwd=tmp_path, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "StopIteration" not in result.stderr


def test_identity_forwarding_an_outer_value_stays():
    """The scope rule itself: a body keeps the Identity that makes its output; everything
    else the simplifier may remove still goes."""
    model = ir.serde.deserialize_model(if_forwarding())
    main = model.graph
    main_identity = ir.node("Identity", [main.outputs[0]], name="main.identity")
    main.append(main_identity)
    main.outputs[0] = main_identity.outputs[0]
    main_identity.outputs[0].name = "out0.id"
    ScopedIdentityEliminationPass()(model)
    assert stray_outputs(model) == set()
    branches = [a.as_graph() for n in main for a in n.attributes.values() if n.op_type == "If"]
    assert all(len(list(b)) == 3 for b in branches), "each forwarded output keeps its Identity"
    assert not any(n.name == "main.identity" for n in main), "a plain Identity still goes"
    assert [v.name for v in main.outputs] == ["out0.id", "out1", "out2"]


def test_torchscript_if_compiles_verified(tmp_path):
    torch = pytest.importorskip("torch")

    class Gate(torch.nn.Module):
        """A streaming gate: keep the state, or mix the new frame into it (VAD-like)."""

        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(3, 3)

        def forward(self, x: torch.Tensor, state: torch.Tensor):
            hidden = torch.relu(self.proj(x))
            if bool(x.sum() > 0):
                out, new_state = hidden, state
            else:
                out, new_state = hidden * 2.0, state + hidden
            return out, new_state

    torch.manual_seed(0)
    path = tmp_path / "gate.onnx"
    with pytest.warns(DeprecationWarning):  # the TorchScript exporter says it is legacy
        torch.onnx.export(
            torch.jit.script(Gate()), (torch.randn(2, 3), torch.zeros(2, 3)), str(path),
            dynamo=False, input_names=["x", "state"], output_names=["out", "new_state"],
            opset_version=17,
        )  # fmt: skip
    model = onnx.load(str(path))
    (if_node,) = [n for n in model.graph.node if n.op_type == "If"]
    then_ops = [n.op_type for a in if_node.attribute if a.name == "then_branch" for n in a.g.node]
    assert then_ops == ["Identity", "Identity"], "the export this test is about"
    artifact, _ = compile_quietly(path, tmp_path / "gate.kiln")
    assert artifact.manifest.verification.ok
    assert artifact.manifest.dropped_passes == []
    state = np.full((2, 3), 0.5, np.float32)
    feeds = [{"x": X, "state": state}, {"x": -X - 1, "state": state}]  # sum > 0, then < 0
    assert_runs_like_original(artifact, model, feeds)


# --- The crash path: passes that raise or strand a body output are dropped and named. ---


class BodyCrash(KilnPass):
    """A pass with a bug that shows only on control flow: it raises inside a body."""

    name = "body-crash"
    stage = "fuse"
    summary = "raises on If/Loop bodies"

    def apply(self, model: ir.Model) -> int:
        for node in ir.traversal.RecursiveGraphIterator(model.graph):
            if node.graph is not model.graph:
                raise ValueError(f"cannot handle node {node.name} inside a body")
        return 0


class StrandOutputs(KilnPass):
    """onnx_ir's own identity elimination, which leaves a body output pointing at an outer
    value (ONNX Runtime then refuses the model)."""

    name = "strand-outputs"
    stage = "simplify"
    summary = "onnx_ir identity elimination"

    def apply(self, model: ir.Model) -> int:
        return int(common.IdentityEliminationPass()(model).modified)


def _spec(cls: type[KilnPass]) -> PassSpec:
    return PassSpec(cls.name, cls.stage, cls, cls.summary)


def _control_flow_file(tmp_path, make=if_computing):
    path = tmp_path / "cf.onnx"
    model = make()
    onnx.save(model, path)
    return path, model


def test_crashing_passes_in_a_pipeline_that_repeats_names_are_dropped(tmp_path):
    path, model = _control_flow_file(tmp_path)
    pipeline = default_pipeline()
    names = [s.name for s in pipeline]
    assert names.count("simplify") > 1 and names.count("refine-shapes") > 1
    # The same crashing pass twice, one right after a repeated simplify, one at the end.
    pipeline.insert(names.index("simplify", 1) + 1, _spec(CrashingPass))
    pipeline.append(_spec(CrashingPass))
    pipeline.insert(2, _spec(BodyCrash))
    artifact, said = compile_quietly(path, tmp_path / "m.kiln", pipeline=pipeline)
    manifest = artifact.manifest
    assert sorted(manifest.dropped_passes) == ["body-crash", "crash", "crash"]
    assert manifest.verification.ok
    assert any("body-crash crashed: ValueError" in line for line in said)
    applied = [p.name for p in manifest.passes]
    assert applied.count("simplify") == names.count("simplify"), "the other passes all ran"
    assert_runs_like_original(artifact, model, _feeds("if_computing"))


def if_one_forwarding() -> onnx.ModelProto:
    """One branch forwards a value computed outside; the other computes."""
    then_branch = _branch("then", [h.make_node("Identity", ["a"], ["t0"])], "t0")
    else_branch = _branch("else", [h.make_node("Neg", ["x"], ["e0"])], "e0")
    return _if_model(then_branch, else_branch, [h.make_node("Relu", ["x"], ["a"])])


def test_a_pass_that_strands_a_body_output_is_dropped_and_named(tmp_path):
    path, model = _control_flow_file(tmp_path, if_one_forwarding)
    pipeline = default_pipeline()
    pipeline.insert(1, _spec(StrandOutputs))
    artifact, said = compile_quietly(path, tmp_path / "m.kiln", pipeline=pipeline)
    assert artifact.manifest.dropped_passes == ["strand-outputs"]
    assert artifact.manifest.verification.ok
    message = next(line for line in said if "strand-outputs crashed" in line)
    assert "then_branch of If node 'if'" in message and "made by no node there" in message
    assert_valid_artifact(artifact)
    assert_runs_like_original(artifact, model, _feeds("if_one_forwarding"))


def test_a_crashing_tidy_up_after_a_pipeline_without_cleanup_is_dropped(tmp_path, monkeypatch):
    """The cleanup appended to a pipeline that lacks one is no entry of that pipeline: its
    crash must still be dropped and named (it used to raise StopIteration)."""
    crashing_cleanup = PassSpec("cleanup", "memory", CrashingPass, "raises")
    monkeypatch.setattr(passes_stage, "_cleanup", lambda: crashing_cleanup)
    path, model = _control_flow_file(tmp_path)
    by_name = {s.name: s for s in default_pipeline()}
    pipeline = [by_name["simplify"], by_name["refine-shapes"], by_name["simplify"]]
    artifact, _ = compile_quietly(path, tmp_path / "m.kiln", pipeline=pipeline)
    assert artifact.manifest.dropped_passes == ["cleanup"]
    assert [p.name for p in artifact.manifest.passes] == ["simplify", "refine-shapes", "simplify"]
    assert artifact.manifest.verification.ok
    assert_runs_like_original(artifact, model, _feeds("if_computing"))


class BreakingCleanup(KilnPass):
    """A tidy-up that breaks the outputs (turns every Relu into a Sigmoid, bodies included)."""

    name = "cleanup"
    stage = "memory"
    summary = "wrong"

    def apply(self, model: ir.Model) -> int:
        count = 0
        for node in ir.traversal.RecursiveGraphIterator(model.graph):
            if node.op_type == "Relu":
                node.op_type = "Sigmoid"
                count += 1
        return count


def test_bisection_blames_a_breaking_tidy_up_not_the_first_pass(tmp_path, monkeypatch):
    monkeypatch.setattr(
        passes_stage, "_cleanup", lambda: PassSpec("cleanup", "memory", BreakingCleanup, "")
    )
    path, model = _control_flow_file(tmp_path)
    by_name = {s.name: s for s in default_pipeline()}
    pipeline = [by_name["simplify"], by_name["refine-shapes"], by_name["simplify"]]
    artifact, _ = compile_quietly(path, tmp_path / "m.kiln", pipeline=pipeline)
    assert artifact.manifest.dropped_passes == ["cleanup"]
    assert artifact.manifest.verification.ok
    assert_runs_like_original(artifact, model, _feeds("if_computing"))
