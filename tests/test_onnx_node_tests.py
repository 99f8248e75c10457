"""ONNX's own backend node tests, compiled by Kiln and run in ONNX Runtime.

A deterministic sample of the node tests that ship with the onnx wheel
(`onnx.backend.test.case.node`) is written to disk, loaded with `kiln.ir.load_model`, compiled
with Kiln's full default pipeline *and verified* on the test's own inputs, given as a user gives
them (an .npz per data set, strings as numpy text arrays; sequences, which an .npz cannot hold,
as arrays), and run in ONNX Runtime (CPU, basic optimisation) against the expected outputs
stored with each test, compared exactly as onnx's backend runner compares them.

The contract checked here:

- every test whose *original* model ONNX Runtime runs and passes also passes once compiled,
  and verification drops none of its passes;
- every node of every compiled model traces back to original nodes (`kiln.origin`);
- Kiln refuses a model (at load, or because verification fails) only where ONNX Runtime fails
  on it too, or where the model is older than the opset floor ONNX Runtime guarantees (7,
  `kiln.ir.load.MIN_OPSET`): outputs with NaN or inf alike on both sides, and string inputs,
  are not reasons to refuse.

A failure names the ONNX test, what went wrong and, for wrong outputs, the first pass of the
pipeline after which the test fails. The whole suite (every node test, a few minutes) runs with
`-m slow`.
"""

from __future__ import annotations

import warnings
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx.backend.test.case.test_case import TestCase
from onnx.backend.test.runner import Runner

from kiln.backends.ort import OrtBackend, OrtOptions
from kiln.compiler import CompileConfig, compile_candidate
from kiln.errors import KilnError
from kiln.ir import all_nodes, load_model, origins_of, stamp_origins
from kiln.ir.inputs import read_inputs
from kiln.ir.load import MIN_OPSET, LoadedModel
from kiln.passes import PassSpec, default_pipeline, run_pipeline

# One test in SAMPLE_MODULUS, chosen by a hash of its name: deterministic, and a node test that
# a newer onnx adds or removes does not reshuffle the rest of the sample. 1/6 keeps the file
# near 45 s on two cores, verification included (1/3 took a minute and a half of a CI run
# that must stay under 30 minutes); all ~1900 run with -m slow.
SAMPLE_MODULUS = 6
MIN_ORT_PASSING = 150
# The reference and the compiled model run alike: basic graph optimisation, one thread each.
ORT_OPTIONS = OrtOptions(
    optimization="basic", intra_op_threads=1, inter_op_threads=1, spinning=False
)

NOT_TENSORS = "inputs or outputs are neither tensors nor sequences of tensors"
ORT_FAILS = "ONNX Runtime fails on the original"
REFUSED_OK = "refused by Kiln; ONNX Runtime fails on it too"
REFUSED_OLD_OPSET = "refused by Kiln: opset below the floor ONNX Runtime guarantees"
REFUSED_BAD = "refused by Kiln although ONNX Runtime passes it"
PASSED = "passes compiled"
FAILED = "fails compiled"


@dataclass
class Outcome:
    name: str
    status: str
    detail: str = ""
    bare_nodes: list[str] = field(default_factory=list)  # compiled nodes without kiln.origin


def _is_tensor(value: Any) -> bool:
    return isinstance(value, np.ndarray | np.generic | onnx.TensorProto)


def _tensor(value: Any) -> np.ndarray | list[np.ndarray]:
    """As ONNX Runtime takes and gives it: the backend tests store some values as TensorProto
    (float8, int4...), numpy scalars, or lists of tensors (sequences)."""
    if isinstance(value, list):
        return [np.asarray(_tensor(v)) for v in value]
    if isinstance(value, onnx.TensorProto):
        return onnx.numpy_helper.to_array(value)
    return np.asarray(value)


def _plain(values: list[Any]) -> bool:
    """Tensors or sequences of tensors; optionals (None) and maps are left out."""
    return all(
        _is_tensor(v) or (isinstance(v, list) and all(_is_tensor(x) for x in v)) for v in values
    )


def _first_lines(exc: BaseException, count: int = 6) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: " + " | ".join(lines[:count])


def _root_cause(exc: BaseException) -> str:
    """The innermost exception of a chain: pass managers wrap the real error several times."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return _first_lines(exc)


def _check(model: ir.Model | str, case: TestCase) -> None:
    """Run `model` on each of the case's data sets; raise if ORT fails or outputs differ."""
    assert case.model is not None and case.data_sets is not None
    input_names = [v.name for v in case.model.graph.input]
    output_names = [v.name for v in case.model.graph.output]
    exe = OrtBackend().compile(model, ORT_OPTIONS)
    for inputs, expected in case.data_sets:
        feeds = {name: _tensor(v) for name, v in zip(input_names, inputs, strict=True)}
        got = exe.run(feeds, output_names)
        Runner.assert_similar_outputs(
            [_tensor(v) for v in expected], got, case.rtol, case.atol, case.name
        )


def _opset(proto: onnx.ModelProto) -> int:
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)


def _guilty_pass(path: str, case: TestCase, pipeline: list[PassSpec]) -> str:
    """The pass at the end of the shortest pipeline prefix after which the case fails.

    Like Kiln's own bisection, each prefix ends with cleanup: a prefix may stop between
    fusions that leave helper functions behind.
    """
    cleanup = [s for s in pipeline if s.name == "cleanup"][-1:]
    for end in range(1, len(pipeline) + 1):
        model = load_model(path).model
        stamp_origins(model)
        prefix = pipeline[:end]
        if prefix[-1].name != "cleanup":
            prefix = prefix + cleanup
        try:
            run_pipeline(model, prefix)
            _check(model, case)
        except Exception:  # any failure ends the search: this prefix is the guilty one
            return pipeline[end - 1].name
    return "none (each prefix passes alone)"


def _given_inputs(case: TestCase, loaded: LoadedModel, directory: Path) -> list[dict]:
    """The case's input sets as a user gives them: an .npz per set, read by Kiln, strings
    saved as numpy text arrays (an .npz holds no object arrays without pickling). Sets with
    sequence inputs, which an .npz cannot hold, are given as they are."""
    assert case.model is not None and case.data_sets is not None
    names = [v.name for v in case.model.graph.input]
    sets = []
    for index, (inputs, _) in enumerate(case.data_sets):
        arrays = {name: _tensor(v) for name, v in zip(names, inputs, strict=True)}
        if any(isinstance(a, list) for a in arrays.values()):
            sets.append(arrays)
            continue
        path = directory / f"{case.name}.{index}.npz"
        np.savez(path, **{k: a.astype(str) if a.dtype == object else a for k, a in arrays.items()})
        sets.append(read_inputs(str(path), loaded.model))
    return sets


def _run_case(case: TestCase, directory: Path) -> Outcome:
    assert case.model is not None and case.data_sets is not None
    if not all(_plain(inputs) and _plain(outputs) for inputs, outputs in case.data_sets):
        return Outcome(case.name, NOT_TENSORS)
    path = str(directory / f"{case.name}.onnx")
    onnx.save(case.model, path)
    try:
        _check(path, case)
        original_passes = True
    except Exception:  # ORT raises many types; any of them means "not a reference"
        original_passes = False
    try:
        loaded = load_model(path)
    except KilnError as exc:
        if not original_passes:
            return Outcome(case.name, REFUSED_OK, str(exc))
        if _opset(case.model) < MIN_OPSET:
            return Outcome(case.name, REFUSED_OLD_OPSET, str(exc))
        return Outcome(case.name, REFUSED_BAD, str(exc))
    except Exception as exc:  # the loader must answer bad input with a KilnError, never crash
        return Outcome(case.name, FAILED, f"load_model crashed: {_first_lines(exc)}")
    if not original_passes:
        return Outcome(case.name, ORT_FAILS)
    pipeline = default_pipeline()
    steps: list[str] = []  # the compiler reports "pass NAME" as each pass starts
    try:
        given = _given_inputs(case, loaded, directory)
        result = compile_candidate(
            loaded, CompileConfig(), given, "the test's inputs", pipeline, steps.append
        )
    except KilnError as exc:
        return Outcome(case.name, REFUSED_BAD, str(exc))
    except Exception as exc:
        where = steps[-1] if steps else "before the first pass"
        return Outcome(case.name, FAILED, f"[{where}] compiling raised {_root_cause(exc)}")
    if not result.ok:
        assert result.verification is not None
        summary = result.verification.summary()
        return Outcome(case.name, REFUSED_BAD, f"verification failed: {summary}")
    compiled = result.model
    bare = [f"{n.op_type} '{n.name}'" for n in all_nodes(compiled.graph) if not origins_of(n)]
    if result.dropped:  # a pass crashed or broke the outputs: the compiler says which
        why = [m for m in steps if "dropped" in m] or [f"dropped {', '.join(result.dropped)}"]
        return Outcome(case.name, FAILED, "; ".join(why), bare)
    try:
        _check(compiled, case)
    except Exception as exc:
        guilty = _guilty_pass(path, case, pipeline)
        return Outcome(case.name, FAILED, f"[pass {guilty}] {_first_lines(exc)}", bare)
    return Outcome(case.name, PASSED, bare_nodes=bare)


def _run_cases(modulus: int, directory: Path) -> list[Outcome]:
    """Every node test whose name hashes to 0 modulo `modulus` (1: all of them), run."""
    from onnx.backend.test.case import node

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        # the generators compute expected outputs with numpy, overflowing on purpose
        warnings.simplefilter("ignore")
        cases = node.collect_testcases()
        chosen = [c for c in cases if zlib.crc32(c.name.encode()) % modulus == 0]
        return [_run_case(case, directory) for case in sorted(chosen, key=lambda c: c.name)]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[Outcome]:
    return _run_cases(SAMPLE_MODULUS, tmp_path_factory.mktemp("onnx-node-tests"))


def _listing(failures: list[Outcome], what: str, total: int) -> str:
    lines = [f"{len(failures)} of {total} {what}:"]
    lines += [f"  {o.name}: {o.detail}" for o in failures]
    return "\n".join(lines)


def _summary(outcomes: list[Outcome]) -> str:
    counts = Counter(o.status for o in outcomes)
    return ", ".join(f"{status}: {count}" for status, count in sorted(counts.items()))


def test_sample_has_enough_cases_that_ort_passes(outcomes: list[Outcome]) -> None:
    ort_passing = [o for o in outcomes if o.status in (PASSED, FAILED, REFUSED_BAD)]
    assert len(ort_passing) >= MIN_ORT_PASSING, (
        f"only {len(ort_passing)} sampled node tests pass in ONNX Runtime "
        f"(need {MIN_ORT_PASSING}); {_summary(outcomes)}"
    )


def _failed(outcomes: list[Outcome]) -> str | None:
    compiled = [o for o in outcomes if o.status in (PASSED, FAILED)]
    failures = [o for o in compiled if o.status == FAILED]
    return (
        _listing(failures, "node tests fail after compiling", len(compiled)) if failures else None
    )


def _wrongly_refused(outcomes: list[Outcome]) -> str | None:
    """Among the tests ONNX Runtime passes, Kiln's only refusals are models below opset 7."""
    wrongly_refused = [o for o in outcomes if o.status == REFUSED_BAD]
    if not wrongly_refused:
        return None
    what = f"node tests that ONNX Runtime passes are refused by Kiln (opset ≥ {MIN_OPSET})"
    return _listing(wrongly_refused, what, len(outcomes))


def _without_origin(outcomes: list[Outcome]) -> str | None:
    compiled = [o for o in outcomes if o.status in (PASSED, FAILED)]
    bare = [
        Outcome(o.name, o.status, "no kiln.origin on " + ", ".join(o.bare_nodes))
        for o in compiled
        if o.bare_nodes
    ]
    what = "compiled models have nodes without provenance"
    return _listing(bare, what, len(compiled)) if bare else None


def test_compiled_models_pass_where_originals_pass(outcomes: list[Outcome]) -> None:
    failures = _failed(outcomes)
    assert not failures, failures


def test_kiln_refuses_only_what_ort_cannot_run(outcomes: list[Outcome]) -> None:
    wrongly_refused = _wrongly_refused(outcomes)
    assert not wrongly_refused, wrongly_refused
    old = [o for o in outcomes if o.status == REFUSED_OLD_OPSET]
    assert all("opset" in o.detail for o in old), _listing(old, "refused as too old", len(old))


def test_every_compiled_node_has_an_origin(outcomes: list[Outcome]) -> None:
    bare = _without_origin(outcomes)
    assert not bare, bare


@pytest.mark.slow
def test_every_node_test_keeps_the_contract(tmp_path: Path) -> None:
    """All ~1900 node tests, not a sample: a few minutes on two cores."""
    every = _run_cases(1, tmp_path)
    broken = [_failed(every), _wrongly_refused(every), _without_origin(every)]
    assert not any(broken), "\n".join(t for t in broken if t) + f"\n{_summary(every)}"
