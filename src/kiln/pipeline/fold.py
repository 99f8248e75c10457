"""Folding the glue's array work into a stage's graph: a chain of Kiln ops (ops.py) that made a
model's feed is prepended to the model, a chain applied to its output appended, where the
result is the same and measures faster.

What is folded is what the reference run recorded: for each feed, the chain of ops that made it
from an array the glue had (an input, another model's output), and for each output, the chain
the glue applied to it — the most common one over the stage's calls, kept only where it is
the chain of at least half of them. The folded model (the stage's chosen artifact's graph with
the chains' ONNX forms, ops_onnx.py) is verified on every recorded call it matches against the
eager chain and the stage's own artifact — integer outputs exactly, floats within the fp32
tolerance of `kiln.verify` — then timed against that eager path in kiln.timing's interleaved
rounds (each timed run as many calls at once as the pipeline serves streams, up to the
cores), kept only where it is faster beyond noise; where an output is folded, the whole
function is then run over the data with the fold in place and must score as it does without.

Guarantee at run time (`FoldedModel`, the stage's session as the glue sees it):

- A call whose every folded feed carries exactly the recorded chain (checked per call, from the
  ops' side table) runs the folded model on the arrays those chains started from; any other
  call runs the stage's own artifact with the feeds as given. A pre-processing fold therefore
  never changes what a call computes beyond the fp32 tolerance verified (provided the array a
  chain started from is not changed in place between the chain and the call).
- A folded output is handed back as a stand-in (an empty array) that the recorded chain's ops
  turn into the folded model's result; any other Kiln op on it first recovers the real output
  (the stage's own artifact run again on the call's feeds). Plain numpy on the stand-in reads
  an empty array: a post-processing fold rests on the glue reading that output only through
  Kiln ops, which the end-to-end run over the recorded data checks, and no more.
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, version_converter

from kiln.errors import KilnError
from kiln.pipeline import ops
from kiln.pipeline.ops_onnx import MIN_OPSET, Step, chain_nodes, elem_type
from kiln.pipeline.recording import Call, Recording, record
from kiln.timing import FASTER, Speedup, interleave, speedup
from kiln.verify import FP32_TOLERANCE, relative_max_abs

FOLDED_FILE = "folded.onnx"  # beside model.onnx in the stage's artifact directory
Chain = tuple[Step, ...]
Say = Callable[[str], None]


@dataclass
class Fold:
    """What a stage folds: per feed, the chain that made it; per output, the chain applied."""

    pre: dict[str, Chain] = field(default_factory=dict)
    post: dict[str, Chain] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"pre": self.pre, "post": self.post}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Fold:
        return cls(*({k: _tuples(v) for k, v in data[side].items()} for side in ("pre", "post")))

    def matches(self, call: Call) -> bool:
        return all(call.pre.get(n, (None, ()))[1] == c for n, c in self.pre.items()) and all(
            c in call.post.get(n, []) for n, c in self.post.items()
        )


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def find_fold(calls: Sequence[Call]) -> Fold:
    """The chains to fold for a stage: per feed and per output, the most common recorded
    chain, where at least half of the calls have it."""
    fold = Fold()
    for name in {n for call in calls for n in call.pre}:
        fold.pre.update(_common(name, [c.pre[name][1] for c in calls if name in c.pre], calls))
    for name in {n for call in calls for n in call.post}:
        longest = [max(c.post[name], key=len) for c in calls if c.post.get(name)]
        fold.post.update(_common(name, longest, calls))
    return fold


def _common(name: str, chains: list[Chain], calls: Sequence[Call]) -> dict[str, Chain]:
    chains = [c for c in chains if c]  # a feed an op's chain started from: nothing to fold
    if not chains:
        return {}
    chain, count = Counter(chains).most_common(1)[0]
    return {name: chain} if 2 * count >= len(calls) else {}


def build_folded(
    model: onnx.ModelProto, fold: Fold, roots: Mapping[str, np.ndarray]
) -> onnx.ModelProto:
    """`model` with each pre chain prepended (the feed's name now takes the chain's root, of
    the dtype and rank in `roots`) and each post chain appended (the output keeps its name)."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    folded = onnx.ModelProto()
    folded.CopyFrom(_upgraded(model, opset) if opset < MIN_OPSET else model)
    graph = folded.graph
    for name, chain in fold.pre.items():
        inner = f"kiln_fold/{name}"
        _rename(graph, name, inner)
        root = roots[name]
        nodes, inits, _ = chain_nodes(chain, name, inner, root.dtype, f"kiln_fold/pre/{name}/")
        (index,) = [i for i, v in enumerate(graph.input) if v.name == name]
        graph.input[index].CopyFrom(helper.make_tensor_value_info(
            name, elem_type(root.dtype), [f"{name}_d{i}" for i in range(root.ndim)]))  # fmt: skip
        _prepend(graph, nodes)
        graph.initializer.extend(inits)
    for name, chain in fold.post.items():
        inner = f"kiln_fold/{name}"
        (index,) = [i for i, v in enumerate(graph.output) if v.name == name]
        dtype = helper.tensor_dtype_to_np_dtype(graph.output[index].type.tensor_type.elem_type)
        _rename(graph, name, inner)
        nodes, inits, out = chain_nodes(chain, inner, name, dtype, f"kiln_fold/post/{name}/")
        graph.node.extend(nodes)
        graph.initializer.extend(inits)
        graph.output[index].CopyFrom(helper.make_tensor_value_info(name, elem_type(out), None))
    return folded


def _upgraded(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """`model` converted to the opset the chains' ONNX forms are written for (PP-OCRv4's
    detector is opset 12). A conversion that changed what the model computes would show in
    the folded model's check against the eager chain on every recorded call."""
    try:
        return version_converter.convert_version(model, MIN_OPSET)
    except RuntimeError as exc:  # the converter's own error: an op with no adapter
        raise ValueError(
            f"the model's opset {opset} is below {MIN_OPSET} and did not convert: {exc}"
        ) from None


def _rename(graph: onnx.GraphProto, old: str, new: str) -> None:
    """Every use of tensor `old` in the nodes (and in their subgraphs) becomes `new`."""
    for node in graph.node:
        node.input[:] = [new if n == old else n for n in node.input]
        node.output[:] = [new if n == old else n for n in node.output]
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                _rename(sub, old, new)


def _prepend(graph: onnx.GraphProto, nodes: list[onnx.NodeProto]) -> None:
    existing = list(graph.node)
    del graph.node[:]
    graph.node.extend([*nodes, *existing])


class FoldedModel:
    """A stage's session as the glue sees it once a fold is kept (the module's guarantee)."""

    def __init__(self, session: Any, folded: Any, fold: Fold):
        self.session, self.folded, self.fold = session, folded, fold
        self.outputs = [o.name for o in session.get_outputs()]

    def _roots(self, feeds: Mapping[str, Any]) -> dict[str, Any] | None:
        """The feeds for the folded model, or None where a feed lacks its recorded chain."""
        roots = dict(feeds)
        for name, chain in self.fold.pre.items():
            trace = ops.trace_of(feeds.get(name))
            if trace is None or trace.steps != chain:
                return None
            roots[name] = trace.root
        return roots

    def _hand_back(self, names: list[str], outputs: list, feeds: Mapping[str, Any]) -> list:
        return [self._stand_in(n, o, feeds) if n in self.fold.post else o
                for n, o in zip(names, outputs, strict=True)]  # fmt: skip

    def _stand_in(self, name: str, value: np.ndarray, feeds: Mapping[str, Any]) -> np.ndarray:
        recover = lambda: self.session.run([name], dict(feeds))[0]  # noqa: E731
        pending = ops.Pending(self.fold.post[name], value, recover)
        stand_in = np.empty(0, value.dtype)
        return ops.remember(stand_in, ops.Trace(stand_in, pending=pending))

    def run(self, output_names: list[str] | None, feeds: Mapping[str, Any], *args: Any) -> Any:
        roots = self._roots(feeds)
        if roots is None:
            return self.session.run(output_names, feeds, *args)
        outputs = self.folded.run(output_names, roots, *args)
        return self._hand_back(list(output_names or self.outputs), outputs, feeds)

    def run_batch(self, requests: list[dict[str, Any]]) -> list[list[np.ndarray]]:
        """The calls that match run folded, as one batch; the others as the stage's own."""
        roots = [self._roots(feeds) for feeds in requests]
        matched = [i for i, r in enumerate(roots) if r is not None]
        other = [i for i, r in enumerate(roots) if r is None]
        results: list[Any] = [None] * len(requests)
        for i, out in zip(matched, _batch(self.folded, [roots[i] for i in matched]), strict=True):
            results[i] = self._hand_back(self.outputs, out, requests[i])
        for i, out in zip(other, _batch(self.session, [requests[i] for i in other]), strict=True):
            results[i] = out
        return results

    def close(self) -> None:
        for session in (self.session, self.folded):
            if hasattr(session, "close"):
                session.close()

    def __getattr__(self, name: str) -> Any:  # get_inputs, get_outputs, ... of the stage
        return getattr(self.session, name)


def _batch(session: Any, requests: list) -> list:
    if not requests:
        return []
    if hasattr(session, "run_batch"):
        return session.run_batch(requests)
    return [session.run(None, feeds) for feeds in requests]


def open_folded(stage: Path) -> Any:
    """The folded graph beside the stage's model, on the stage's engine with its options (the
    fixed dims aside: the folded graph's inputs are the chains' roots)."""
    from kiln.runtime import Session

    backend = json.loads((stage / "manifest.json").read_text())["backend"]
    options = {k: v for k, v in backend["options"].items() if k != "dim_overrides"}
    return Session(str(stage / FOLDED_FILE), backend=backend["name"], options=options)


def fold_sessions(sessions: dict[str, Any], manifest: Mapping[str, Any], root: Path) -> dict:
    """The pipeline artifact's sessions, each stage whose fold was kept wrapped in its
    FoldedModel (the folded graph beside the stage's model in its artifact)."""
    wrapped = dict(sessions)
    for name, record_ in manifest.get("folds", {}).items():
        if record_.get("kept"):
            folded = open_folded(root / manifest["stages"][name]["artifact"])
            wrapped[name] = FoldedModel(sessions[name], folded, Fold.from_json(record_))
    return wrapped


# ---- the compile step -------------------------------------------------------------------------

Measure = Callable[[Callable[[], object], Callable[[], object]], Speedup]


def measure_fold(eager: Callable[[], object], folded: Callable[[], object]) -> Speedup:
    """The folded model against the eager ops and the stage's own, in interleaved rounds."""
    samples = interleave({"eager": eager, "folded": folded}, rounds=5, runs=5, warmup=2)
    return speedup(samples["eager"], samples["folded"])


def fold_stages(
    fn: Callable[..., Any], stages: Mapping[str, Any], inputs: list[Any], reference: Recording,
    score: Callable[[list, list], float], say: Say, measure: Measure | None = None,
    streams: int = 1,
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Per stage, what was folded into its chosen artifact and why, or why not: a kept fold's
    graph is written beside the artifact's model (FOLDED_FILE), for write_pipeline to carry.
    `streams`: how many the pipeline serves at once; each timed run is then that many calls at
    once (up to the cores): a fold moves the glue's work onto the engine's threads, which can
    win one call's latency and lose a loaded machine's throughput."""
    folds: dict[str, dict[str, Any]] = {}
    threads = max(1, min(streams, os.cpu_count() or 1))
    with ThreadPoolExecutor(threads, thread_name_prefix="kiln-fold") as pool:
        base = measure or measure_fold

        def loaded(eager: Callable[[], object], folded: Callable[[], object]) -> Speedup:
            return base(_at_once(eager, threads, pool), _at_once(folded, threads, pool))

        for name, stage in stages.items():
            where = Path(stage.candidates[stage.choice])
            folds[name] = _fold_stage(name, where, reference.of(name), loaded, say)
            say(f"  {name}: {'folded' if folds[name]['kept'] else 'not folded'}: "
                f"{folds[name]['reason']}")  # fmt: skip
    for name in [n for n, f in folds.items() if f["kept"] and f["post"]]:
        problem = _end_to_end(fn, stages, name, Fold.from_json(folds[name]), inputs, score)
        if problem:
            (Path(stages[name].candidates[stages[name].choice]) / FOLDED_FILE).unlink()
            folds[name].update(kept=False, reason=problem)
            say(f"  {name}: fold dropped: {problem}")
    return folds


def _at_once(run: Callable[[], object], threads: int, pool: Executor) -> Callable[[], object]:
    """`run` on `threads` threads at once, as one timed run (a barrier starts them together:
    the pool would otherwise hand a quick run's copies to one thread in turn)."""
    if threads == 1:
        return run

    def together(barrier: threading.Barrier) -> None:
        barrier.wait()
        run()

    def loaded() -> None:
        barrier = threading.Barrier(threads)
        for done in [pool.submit(together, barrier) for _ in range(threads)]:
            done.result()

    return loaded


def _fold_stage(
    name: str, where: Path, calls: list[Call], measure: Measure, say: Say
) -> dict[str, Any]:
    """One stage's fold: found, built, verified on its recorded calls, timed."""
    from kiln.artifact import MODEL_FILE

    fold = find_fold(calls)
    out: dict[str, Any] = {"kept": False, **fold.to_json()}
    if not fold.pre and not fold.post:
        return out | {"reason": "no chain of Kiln ops made its feeds or took its outputs"}
    matched = [c for c in calls if fold.matches(c)]
    say(f"  {name}: checking and timing its Kiln ops folded in, on {len(matched)} calls ...")
    out["calls"] = len(matched)
    try:
        roots = {n: matched[0].pre[n][0] for n in fold.pre}
        onnx.save(build_folded(onnx.load(where / MODEL_FILE), fold, roots), where / FOLDED_FILE)
        problem, result = _check(where, fold, matched, measure)
    except (ValueError, OSError, KilnError) as exc:  # named without the compile's temp path
        why = str(exc).replace(f"{where / FOLDED_FILE}: ", "").replace(str(where), name)
        problem, result = f"the chain could not be folded: {why}", None
    if result is None or result.verdict != FASTER:
        (where / FOLDED_FILE).unlink(missing_ok=True)
    if result is None:
        return out | {"reason": problem}
    out |= {"speedup": round(result.value, 3), "verdict": result.verdict}
    if result.verdict != FASTER:
        return out | {"reason": f"not faster than the eager ops ({result.value:.2f}x, "
                                f"{result.verdict})"}  # fmt: skip
    return out | {"kept": True, "reason": f"{result.value:.2f}x faster than the eager ops"}


def _check(
    where: Path, fold: Fold, matched: list[Call], measure: Measure
) -> tuple[str | None, Speedup | None]:
    """The folded model against the eager path on every matched call, then timed: a problem
    in words, or the speedup."""
    from kiln.runtime import Session

    own, folded = Session(str(where)), open_folded(where)
    try:
        eager, fast = _runners(own, folded, fold)
        problem = next((p for c in matched if (p := _differs(eager(c), fast(c)))), None)
        if problem:
            return f"not the same as the eager ops: {problem}", None
        sample = _sample(matched)
        return None, measure(lambda: [eager(c) for c in sample], lambda: [fast(c) for c in sample])
    finally:
        own.close(), folded.close()


# The recorded time one timed run of the sample may take: each path runs it 32 times
# (measure_fold), so a detector's calls of half a second each are timed one at a time.
SAMPLE_SECONDS = 0.5


def _sample(calls: list[Call]) -> list[Call]:
    """Up to eight calls spread over the recording, no more than fit SAMPLE_SECONDS of their
    recorded time (one at least)."""
    out: list[Call] = []
    for call in calls[:: max(1, len(calls) // 8)][:8]:
        if out and sum(c.seconds for c in out) + call.seconds > SAMPLE_SECONDS:
            break
        out.append(call)
    return out


def _runners(own: Any, folded: Any, fold: Fold) -> tuple[Callable, Callable]:
    """A recorded call run as the glue ran it (the chains eagerly, the stage's own model) and
    folded (the chains' roots into the folded model)."""
    names = [o.name for o in own.get_outputs()]

    def eager(call: Call) -> list[np.ndarray]:
        feeds = dict(call.feeds) | {n: ops.apply_steps(call.pre[n][0], c)
                                    for n, c in fold.pre.items()}  # fmt: skip
        outputs = own.run(None, feeds)
        return [ops.apply_steps(o, fold.post[n]) if n in fold.post else o
                for n, o in zip(names, outputs, strict=True)]  # fmt: skip

    def fast(call: Call) -> list[np.ndarray]:
        return folded.run(None, dict(call.feeds) | {n: call.pre[n][0] for n in fold.pre})

    return eager, fast


def _differs(eager: list[np.ndarray], folded: list[np.ndarray]) -> str | None:
    for i, (a, b) in enumerate(zip(eager, folded, strict=True)):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"output {i}: {b.dtype}{list(b.shape)} where {a.dtype}{list(a.shape)}"
        if not np.issubdtype(a.dtype, np.floating):
            if not np.array_equal(a, b):
                return f"output {i}: {int((a != b).sum())} values differ"
        elif a.size and relative_max_abs(a, b) < 1 - FP32_TOLERANCE:
            return f"output {i}: off by {1 - relative_max_abs(a, b):.2g} of its scale"
    return None


def _end_to_end(fn: Callable[..., Any], stages: Mapping[str, Any], name: str, fold: Fold,
                inputs: list[Any], score: Callable[[list, list], float]) -> str | None:  # fmt: skip
    """The function over the data with the fold in place against without: a folded output
    the glue reads other than through Kiln ops shows here."""
    from kiln.runtime import Session

    sessions = {n: Session(str(s.candidates[s.choice])) for n, s in stages.items()}
    where = Path(stages[name].candidates[stages[name].choice])
    folded = FoldedModel(sessions[name], open_folded(where), fold)
    try:
        plain = record(fn, sessions, inputs).results
        got = record(fn, {**sessions, name: folded}, inputs).results
    except KilnError as exc:
        return f"the pipeline fails with it (the glue reads the output beyond the ops): {exc}"
    finally:
        folded.close()
        for session in sessions.values():
            session.close()
    if score(plain, got) < score(plain, plain):
        return "the pipeline's results change with it (the glue reads the output beyond the ops)"
    return None
