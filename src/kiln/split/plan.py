"""`kiln.split`: one model cut into an edge part and a server part, the cut chosen from
measured per-node times and the link's bandwidth, the boundary encoded under the accuracy
budget, both parts verified end to end.

The prediction for a cut: the edge's time for the nodes before it (this machine's × a stated
slowdown, or the edge's own `kiln profile --json`), the transfer of the encoded boundary and of
the answer at the given bandwidth plus a request's fixed cost, and this machine's time for the
nodes after it. `DIR/edge.kiln` and `DIR/server.kiln` are ordinary artifacts whose graphs hold
the codec; both manifests carry a `split` section (the boundary, the codec, the predictions
and the end-to-end verification), which `kiln.Session(edge, remote=URL)` reads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from kiln.artifact import Artifact
from kiln.backends import get_backend, options_from_json
from kiln.compiler.api import ModelLike, build, compile, load_source
from kiln.compiler.reference import fit_original, reference_executable, reference_feeds
from kiln.config import CompileConfig
from kiln.errors import KilnError
from kiln.home import replace_directory
from kiln.ir import stamp_origins
from kiln.ir.inputs import check_feeds, input_names
from kiln.ir.subgraph import extract
from kiln.split.codec import Codec, applies, auto_codecs, decode, encode, parse_codec
from kiln.split.cuts import (
    ALL_EDGE,
    Prediction,
    SplitCut,
    candidate_cuts,
    parse_bandwidth,
    predict_cut,
    resolve_cut,
)
from kiln.split.times import edge_node_times, loopback_overhead_ms, whole_model_times
from kiln.timing import median_ms
from kiln.verify import Budget, Verification, compare

Feeds = dict[str, np.ndarray]
Say = Callable[[str], None]
EDGE, SERVER = "edge.kiln", "server.kiln"
SERVER_MODEL = "server"  # what `kiln serve DIR/server.kiln` serves it as (the file's stem)
MAX_TRIALS = 12  # codec trials before `--codec auto` settles for the lossless one


@dataclass
class SplitResult:
    """What `kiln.split` chose and predicted, and where it wrote the parts."""

    path: Path | None
    chosen: Prediction
    candidates: list[Prediction]
    bandwidth_bps: float
    edge: dict[str, Any]  # how the edge's times were had: {"slowdown": 8} or {"profile": path}
    overhead_ms: float
    overhead_from: str
    verification: Verification | None
    trials: list[dict[str, Any]] = field(default_factory=list)  # codec checks, in order
    boundary: list[dict[str, Any]] = field(default_factory=list)  # wire tensors
    measured_here_ms: dict[str, float] = field(default_factory=dict)  # compiled parts, here
    source: str = ""
    whole_ms: float = 0.0  # the whole compiled model's latency here

    @property
    def edge_path(self) -> Path | None:
        return None if self.path is None else self.path / EDGE

    @property
    def server_path(self) -> Path | None:
        if self.path is None or self.chosen.cut.kind == ALL_EDGE:
            return None
        return self.path / SERVER

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "output": None if self.path is None else str(self.path),
            "chosen": self.chosen.to_json(),
            "candidates": [p.to_json() for p in self.candidates],
            "bandwidth_bps": self.bandwidth_bps,
            "edge": self.edge,
            "overhead_ms": self.overhead_ms,
            "overhead_from": self.overhead_from,
            "whole_model_ms_here": self.whole_ms,
            "measured_here_ms": self.measured_here_ms,
            "server_model": None if self.server_path is None else SERVER_MODEL,
            "boundary": self.boundary,
            "codec_trials": self.trials,
            "verification": self.verification.to_json() if self.verification else None,
        }


@dataclass
class _Plan:
    """What the search works on: the model, its reference inputs and outputs, the tensors of
    every candidate cut on those inputs, and the per-node times of both sides."""

    model: ir.Model
    name: str
    source: str
    feeds: list[Feeds]
    inputs_from: str
    reference: list[list[np.ndarray]]
    tensors: list[dict[str, np.ndarray]]  # per feed set: candidate tensor → value
    cuts: list[SplitCut]
    edge_times: dict[str, float]
    server_times: dict[str, float]
    response_bytes: int
    link: tuple[float, float]
    budget: Budget
    whole_ms: float = 0.0


def split(
    model: ModelLike,
    at: str = "auto",
    output: str | os.PathLike | None = None,
    *,
    bandwidth: str | float = "20Mbit/s",
    edge_slowdown: float | None = None,
    edge_profile: str | os.PathLike | None = None,
    codec: str = "auto",
    inputs: str | Mapping[str, np.ndarray] | None = None,
    overhead_ms: float | None = None,
    runs: int = 20,
    force: bool = False,
    progress: Say | None = None,
) -> SplitResult:
    """Cut `model` (a path, zoo:NAME, an onnx/onnx_ir model) between an edge device and a
    server and write `output/edge.kiln` and `output/server.kiln` (None: predict and choose,
    write nothing).

    `at`: "auto" (the least predicted end-to-end time), a node name, a tensor name, or tensors
    joined by ','. `bandwidth`: "20Mbit/s", "1Gbit/s", "5MB/s" or bits/s. The edge's times are
    this machine's × `edge_slowdown` (default 8) or those of `edge_profile`, the JSON `kiln
    profile MODEL --json` wrote on the edge. `codec`: auto (the fewest bytes whose end-to-end
    outputs stay within the budget, cosine ≥ 0.99), none, fp16, int8, topk or topk:FRACTION.
    `overhead_ms`: a request's fixed cost on the link (default: a null request's round trip on
    loopback, measured). Raises KilnError, writing nothing, on a cut that does not separate the
    graph, a tensor inside a control-flow body, a bad bandwidth, or outputs out of budget."""
    say = progress or (lambda _m: None)
    link_bps = parse_bandwidth(bandwidth)
    chosen_codec = parse_codec(codec)
    edge_how = _edge_source(edge_slowdown, edge_profile)
    if runs < 1:
        raise KilnError(f"--runs {runs}: use at least 1.")
    destination = _check_output(output, force)
    say(f"loading {model}")
    loaded = load_source(model)
    stamp_origins(loaded.model)  # names every node: cuts and times speak of the same nodes
    cuts = candidate_cuts(loaded.model)
    fixed = None if at == "auto" else resolve_cut(loaded.model, at, cuts)  # before measuring
    plan, whole = _plan(loaded, cuts, inputs, edge_how, say, runs)
    overhead, overhead_from = _overhead(overhead_ms)
    plan.link = (link_bps, overhead)
    chosen, candidates, trials = _choose(plan, fixed, chosen_codec, say)
    result = SplitResult(
        path=None, chosen=chosen, candidates=candidates, bandwidth_bps=link_bps, edge=edge_how,
        overhead_ms=overhead, overhead_from=overhead_from, verification=None, trials=trials,
        source=loaded.source, whole_ms=whole,
    )  # fmt: skip
    if destination is not None:
        _write(plan, result, destination, say)
    return result


def _edge_source(slowdown: float | None, profile: str | os.PathLike | None) -> dict[str, Any]:
    if slowdown is not None and profile is not None:
        raise KilnError(
            "give --edge-slowdown or --edge-profile, not both: the profile is the edge's own "
            "times, the slowdown scales this machine's."
        )
    if profile is not None:
        return {"profile": str(profile)}
    slowdown = 8.0 if slowdown is None else float(slowdown)
    if not slowdown > 0 or slowdown == float("inf"):
        raise KilnError(f"--edge-slowdown {slowdown:g}: use a factor > 0 (e.g. 8).")
    return {"slowdown": slowdown}


def _check_output(output: str | os.PathLike | None, force: bool) -> Path | None:
    """Refuse, before any work, an -o that cannot receive the two artifacts."""
    if output is None:
        return None
    from kiln.home import output_problem

    destination = Path(output)
    problem = output_problem(destination, directory=True)
    if problem:
        raise KilnError(f"-o {destination}: {problem}. Nothing was done; choose another -o path.")
    if destination.is_symlink() or destination.is_file():
        raise KilnError(f"-o {destination}: is not a directory; choose another -o path.")
    if destination.is_dir() and not force:
        foreign = sorted(p.name for p in destination.iterdir() if p.name not in (EDGE, SERVER))
        if foreign:
            raise KilnError(
                f"-o {destination}: holds files kiln split did not write ({', '.join(foreign[:5])}"
                "); refusing to replace it. Choose another -o path or pass --force."
            )
    return destination


def _overhead(given: float | None) -> tuple[float, str]:
    if given is not None:
        if not given >= 0:
            raise KilnError(f"--overhead-ms {given}: use 0 or more.")
        return float(given), "given"
    return loopback_overhead_ms(), "measured: a null HTTP request's round trip on loopback"


# ---------------------------------------------------------------------------- measuring


def _plan(
    loaded: Any, cuts: list[SplitCut], inputs: Any, edge_how: dict[str, Any], say: Say, runs: int
) -> tuple[_Plan, float]:
    original = loaded.model
    feeds, source = _feeds(original, inputs)
    say("running the original in ONNX Runtime (reference)")
    reference, tensors = _run_with_boundaries(original, feeds, cuts)
    say("compiling and profiling the whole model on this machine")
    result, _ = build(loaded, CompileConfig(verify=False), rounds=0)
    here, whole = whole_model_times(result.model, result.backend, result.options, feeds[0], runs)
    if "profile" in edge_how:
        edge, _ = edge_node_times(Path(edge_how["profile"]), original)
    else:
        edge = {n: t * edge_how["slowdown"] for n, t in here.items()}
    response = sum(int(np.asarray(o).nbytes) for o in reference[0])
    plan = _Plan(
        model=original, name=loaded.name, source=loaded.source, feeds=feeds, inputs_from=source,
        reference=reference, tensors=tensors, cuts=cuts, edge_times=edge, server_times=here,
        response_bytes=response, link=(1.0, 0.0), budget=Budget(), whole_ms=whole,
    )  # fmt: skip
    return plan, whole


def _feeds(model: ir.Model, inputs: Any) -> tuple[list[Feeds], str]:
    """The user's reference inputs (an .npz path or a dict), else two synthesized sets."""
    if inputs is None:
        fit = fit_original(model)
        return reference_feeds(model, None, "synthesized", fit)
    if isinstance(inputs, str | os.PathLike):
        from kiln.ir.inputs import read_inputs

        return [read_inputs(str(inputs), model)], str(inputs)
    feeds = {name: np.asarray(value) for name, value in dict(inputs).items()}
    check_feeds(model, feeds, where="split inputs")
    return [feeds], "given arrays"


def _run_with_boundaries(
    model: ir.Model, feeds: list[Feeds], cuts: list[SplitCut]
) -> tuple[list[list[np.ndarray]], list[dict[str, np.ndarray]]]:
    """The original's outputs on each feed set, and every candidate cut's tensors on it (one
    run of a copy that also outputs them)."""
    copy = ir.serde.deserialize_model(ir.serde.serialize_model(model))
    outputs = [v.name for v in copy.graph.outputs]
    wanted = sorted({t for c in cuts if c.kind != ALL_EDGE for t in c.tensors} - set(outputs))
    values = {v.name: v for n in copy.graph for v in n.outputs if v.name}
    extra = [values[t] for t in wanted if t in values]
    copy.graph.outputs.extend(extra)
    executable = reference_executable(copy)
    reference, tensors = [], []
    for feed in feeds:
        got = executable.run(feed)
        reference.append(got[: len(outputs)])
        named = dict(zip(outputs + [v.name for v in extra], got, strict=True))
        tensors.append({**feed, **named})
    return reference, tensors


# ---------------------------------------------------------------------------- choosing


def _choose(
    plan: _Plan, fixed: SplitCut | None, codec: Codec | None, say: Say
) -> tuple[Prediction, list[Prediction], list[dict[str, Any]]]:
    """The cut (fixed or the least predicted total) with the codec (given, or the fewest
    bytes within the budget): each (cut, codec) pair is tried in order of predicted total, its
    outputs checked end to end on the reference inputs, until one passes."""
    codecs = [codec] if codec is not None else auto_codecs()
    cuts = [fixed] if fixed is not None else plan.cuts
    pairs = [_predict(plan, cut, c) for cut in cuts for c in codecs if _useful(plan, cut, c)]
    pairs.sort(key=lambda p: (p.total_ms, p.wire_bytes))
    trials: list[dict[str, Any]] = []
    failed: set[tuple[tuple[str, ...], str]] = set()
    for pair in pairs:
        if pair.codec.lossless or pair.cut.kind == ALL_EDGE:
            pair.verified = True
            break
        if len(trials) >= MAX_TRIALS:
            continue
        say(f"checking codec {pair.codec.label} at {pair.cut.label}")
        check = _trial(plan, pair.cut, pair.codec)
        trials.append({"cut": list(pair.cut.tensors), "codec": pair.codec.label,
                       "ok": check.ok, "summary": check.summary()})  # fmt: skip
        pair.verified = check.ok
        if check.ok:
            break
        failed.add((pair.cut.tensors, pair.codec.label))
        if codec is not None and fixed is not None:
            raise KilnError(
                f"{plan.source}: with --codec {codec.label} at {fixed.label} the outputs leave "
                f"the accuracy budget ({check.summary()}). Nothing was written; use a lossless "
                "or milder codec (--codec fp16, none or auto)."
            )
    chosen = next((p for p in pairs if p.verified), None)
    if chosen is None:  # a lossy codec given, and no cut tried kept the outputs in budget
        raise KilnError(
            f"{plan.source}: with --codec {codecs[0].label} no cut tried kept the outputs within "
            f"the accuracy budget ({len(trials)} tried). Nothing was written; use --codec auto "
            "or a milder codec (fp16, none)."
        )
    # Every candidate is reported, whether chosen by the search or given with --at.
    shown = plan.cuts if fixed is None or fixed in plan.cuts else [*plan.cuts, fixed]
    table = _table(plan, shown, codecs, failed, chosen)
    return chosen, table, trials


def _useful(plan: _Plan, cut: SplitCut, codec: Codec) -> bool:
    """A lossy codec is a candidate only where it encodes something (an fp32 boundary)."""
    if codec.lossless:
        return True
    if cut.kind == ALL_EDGE:
        return False
    values = [plan.tensors[0][t] for t in cut.tensors]
    return any(applies(codec, v.dtype, v.shape) for v in values)


def _predict(plan: _Plan, cut: SplitCut, codec: Codec) -> Prediction:
    return predict_cut(
        cut, codec, plan.edge_times, plan.server_times, plan.tensors[0], plan.response_bytes,
        plan.link,
    )  # fmt: skip


def _table(
    plan: _Plan,
    cuts: list[SplitCut],
    codecs: list[Codec],
    failed: set[tuple[tuple[str, ...], str]],
    chosen: Prediction,
) -> list[Prediction]:
    """One row per cut, in graph order: the chosen pair on its cut; elsewhere the smallest
    codec not known to leave the budget (its check marked as not tried)."""
    rows = []
    for cut in cuts:
        if cut == chosen.cut:
            rows.append(chosen)
            continue
        usable = [c for c in codecs if _useful(plan, cut, c)]
        usable = [c for c in usable if (cut.tensors, c.label) not in failed] or [Codec("none")]
        best = min((_predict(plan, cut, c) for c in usable), key=lambda p: p.wire_bytes)
        best.verified = True if best.codec.lossless else None
        rows.append(best)
    return rows


def _trial(plan: _Plan, cut: SplitCut, codec: Codec) -> Verification:
    """The pieces with the codec, run in ONNX Runtime (reference settings), end to end against
    the original's outputs on the reference inputs."""
    edge, server = pieces(plan.model, cut, codec, plan.tensors[0])
    edge_run = reference_executable(edge).run
    server_run = reference_executable(server).run if server is not None else None
    got = [_chain(edge_run, edge, server_run, server, feed) for feed in plan.feeds]
    return _compare(plan, got, codec)


def _chain(edge_run: Callable, edge: Any, server_run: Callable | None, server: Any, feed: Feeds):
    """Edge outputs → server inputs (by name) → the server's outputs."""
    edge_names = _output_names(edge)
    wire = dict(zip(edge_names, edge_run(feed), strict=True))
    if server_run is None:
        return list(wire.values())
    return server_run({name: wire[name] for name in _input_names(server)})


def _output_names(model: Any) -> list[str]:
    if isinstance(model, ir.Model):
        return [v.name for v in model.graph.outputs]
    return list(model.output_names)


def _input_names(model: Any) -> list[str]:
    if isinstance(model, ir.Model):
        return input_names(model)
    return list(model.input_names)


def _compare(plan: _Plan, got: list[list[np.ndarray]], codec: Codec) -> Verification:
    names = [v.name for v in plan.model.graph.outputs]
    precision = "fp32" if codec.lossless else codec.label
    return compare(names, plan.reference, got, plan.inputs_from, precision, budget=plan.budget)


def pieces(
    model: ir.Model, cut: SplitCut, codec: Codec, values: dict[str, np.ndarray]
) -> tuple[ir.Model, ir.Model | None]:
    """The edge piece (ending with the encoding) and the server piece (beginning with the
    decoding) of `model` at `cut`; all on the edge has no server piece."""
    inputs = input_names(model)
    outputs = [v.name for v in model.graph.outputs]
    base = model.graph.name or "model"
    if cut.kind == ALL_EDGE:
        return extract(model, inputs, outputs, name=f"{base}_edge"), None
    edge = extract(model, inputs, list(cut.tensors), name=f"{base}_edge")
    server = extract(model, list(cut.tensors), outputs, name=f"{base}_server")
    for tensor in cut.tensors:
        value = values[tensor]
        encode(edge, tensor, codec, value.shape)
        decode(server, tensor, codec, value.dtype, value.shape, tensor in inputs)
    return edge, server


# ---------------------------------------------------------------------------- writing


def _write(plan: _Plan, result: SplitResult, destination: Path, say: Say) -> None:
    """Both artifacts into a temporary sibling, verified end to end, then swapped in whole:
    on any failure what was at `destination` stays (--force was checked before the work)."""

    def fill(tmp: Path) -> None:
        edge_art, server_art = _build_parts(plan, result, tmp, say)
        say("verifying edge → server end to end")
        result.verification, result.measured_here_ms = _verify_parts(plan, result, edge_art,
                                                                     server_art)  # fmt: skip
        if not result.verification.ok:
            raise KilnError(
                f"{plan.source}: the compiled parts at {result.chosen.cut.label} with codec "
                f"{result.chosen.codec.label} leave the budget end to end "
                f"({result.verification.summary()}). Nothing was written."
            )
        result.boundary = list(server_art.manifest.inputs) if server_art else []
        _record(edge_art, server_art, plan, result)

    try:
        replace_directory(destination, fill)
    except OSError as exc:
        raise KilnError(
            f"-o {destination}: could not write the parts ({exc.strerror or exc}). Nothing was "
            "written."
        ) from None
    result.path = destination


def _build_parts(
    plan: _Plan, result: SplitResult, tmp: Path, say: Say
) -> tuple[Artifact, Artifact | None]:
    chosen = result.chosen
    edge, server = pieces(plan.model, chosen.cut, chosen.codec, plan.tensors[0])
    say("compiling the edge part")
    # With a server, the edge's pool stops spinning when its part ends: the edge then waits on
    # the link, and on a machine it shares with the server (loopback) a spinning pool takes a
    # core from it (resnet50's server part ran 60 → 125 ms a request beside one).
    options = {"stop_spinning": True} if server is not None else {}
    edge_art = compile(
        edge, tmp / EDGE, inputs=plan.feeds[0], rounds=0, backend="ort", engine_options=options
    )
    if server is None:
        return edge_art, None
    say("compiling the server part")
    wire = _wire_feeds(edge_art, plan.feeds[0])
    server_art = compile(server, tmp / SERVER, inputs=wire, rounds=0)
    return edge_art, server_art


def _executable(artifact: Artifact) -> Any:
    backend = artifact.manifest.backend
    options = options_from_json(backend.name, backend.options)
    return get_backend(backend.name).compile(str(artifact.model_path), options)


def _wire_feeds(edge: Artifact, feed: Feeds) -> Feeds:
    executable = _executable(edge)
    return dict(zip(executable.output_names, executable.run(feed), strict=True))


def _verify_parts(
    plan: _Plan, result: SplitResult, edge_art: Artifact, server_art: Artifact | None
) -> tuple[Verification, dict[str, float]]:
    """The compiled parts chained on every reference input against the original; and each
    part's median time here (for the record beside the prediction)."""
    edge = _executable(edge_art)
    server = _executable(server_art) if server_art is not None else None
    server_run = server.run if server is not None else None
    got = [_chain(edge.run, edge, server_run, server, feed) for feed in plan.feeds]
    verification = _compare(plan, got, result.chosen.codec)
    feed = plan.feeds[0]
    times = {"edge_ms": median_ms(lambda: edge.run(feed), 10)}
    if server is not None:
        wire = dict(zip(edge.output_names, edge.run(feed), strict=True))
        wire = {n: wire[n] for n in server.input_names}
        times["server_ms"] = median_ms(lambda: server.run(wire), 10)
    return verification, times


def _record(
    edge_art: Artifact, server_art: Artifact | None, plan: _Plan, result: SplitResult
) -> None:
    """The `split` section of both manifests: what the remote session checks and reads."""
    common = {
        "source": {"name": plan.name, "path": plan.source},
        "cut": list(result.chosen.cut.tensors),
        "kind": result.chosen.cut.kind,
        "codec": result.chosen.codec.to_json(),
        "boundary": result.boundary,
        "outputs": list(
            edge_art.manifest.outputs if server_art is None else server_art.manifest.outputs
        ),  # fmt: skip
        "bandwidth_bps": result.bandwidth_bps,
        "edge_times": result.edge,
        "overhead_ms": result.overhead_ms,
        "predicted": result.chosen.to_json(),
        "candidates": [p.to_json() for p in result.candidates],
        "verification": result.verification.to_json() if result.verification else None,
    }
    server_model = SERVER_MODEL if server_art is not None else None
    _add_section(edge_art, {"role": "edge", "server_model": server_model, **common})
    if server_art is not None:
        _add_section(server_art, {"role": "server", "edge_model": "edge", **common})


def _add_section(artifact: Artifact, section: dict[str, Any]) -> None:
    """The manifest's `split` field (Manifest.split), written into the part just built."""
    path = artifact.path / "manifest.json"
    data = json.loads(path.read_text())
    data["split"] = section
    path.write_text(json.dumps(data, indent=2, default=float) + "\n")
