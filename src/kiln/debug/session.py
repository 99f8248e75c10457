"""A `kiln debug` session: the side being debugged, what it is measured against, the inputs,
where execution stands, and what the page asks of them.

* **main** — `kiln debug MODEL|ARTIFACT`: the graph that runs (the compiled pane) and its
  original graph (the original pane), tied by provenance.
* **reference** — `--against B`, or else, for a compiled side, its original run as-is (ONNX
  Runtime, basic optimisation, fp32: what every compile is verified against). A plain model
  without `--against` has none: nothing to measure an error against.

Execution reveals the tensors of one exposed run of the main graph (every tensor it computes
made a graph output; its fusions stay) in topological order; the run is made once per input
set and kept, as are the reference's run, the layer-wise comparison (`kiln.debug.compare`)
and the profile (`kiln.profile`, once per session). Changing an input starts a new set.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx_ir as ir

from kiln.debug.compare import compare_sides, run_exposed
from kiln.debug.graph_json import (
    attributes_json,
    graph_json,
    op_name,
    scope_of,
    shared_scope,
    topological,
    value_json,
)
from kiln.debug.kernels import profile_view
from kiln.debug.sides import Side, load_side, synthesized_feeds
from kiln.debug.stepper import Stepper
from kiln.debug.tensors import tensor_json, to_npy
from kiln.errors import KilnError

Say = Callable[[str], None]
SIDES = ("main", "against")
PANES = ("original", "compiled")


class _Cached:
    """One value per input set, computed once even when several requests ask at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._version = -1
        self._value: Any = None

    def get(self, version: int, compute: Callable[[], Any]) -> Any:
        with self._lock:
            if self._version != version:
                self._value = compute()
                self._version = version
            return self._value

    def peek(self, version: int) -> Any:
        """The value if it is computed for this input set, else None (never computes)."""
        return self._value if self._version == version else None


class DebugSession:
    """Everything the debugger shows, computed when first asked and kept."""

    def __init__(
        self,
        spec: str,
        *,
        against: str | None = None,
        inputs: str | None = None,
        shapes: dict[str, tuple[int, ...]] | None = None,
        peaks: Any = None,
        profile_runs: int = 10,
        say: Say = lambda _msg: None,
    ) -> None:
        say(f"loading {spec}")
        self.main = load_side(spec, inputs=inputs, shapes=shapes, say=say)
        self.against = None
        if against is not None:
            say(f"loading {against}")
            self.against = load_side(against, inputs=inputs, shapes=shapes, say=say)
        self.original = _original_graph(self.main, self.against)
        self.reference = self.against or _reference(self.main)
        self.shapes = shapes or self.main.shapes
        self.peaks = peaks
        self.profile_runs = profile_runs
        self.notes = [*self.main.notes, *(self.against.notes if self.against else [])]
        self.stepper = Stepper([node.name for node in topological(self.main.model)])
        self._nodes = {node.name: node for node in self.main.model.graph}
        self._original_nodes = {node.name: node for node in self.original.graph}
        self._counterparts = self._compiled_of_original()
        self._lock = threading.Lock()  # feeds, version and the stepper change together
        self.version = 0
        self.feeds, self.input_source = self._first_feeds(inputs)
        self._runs = {side: _Cached() for side in SIDES}
        self._comparison = _Cached()
        self._profile = _Cached()
        self._graphs = _Cached()

    # ---- what the page draws -------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        reference = self.reference
        return {
            "main": {**self.main.describe(), "label": self.main.label},
            "reference": None if reference is None else {**reference.describe(),
                                                         "label": reference.label},
            "against": self.against is not None,
            "original": self.original.graph.name or "main_graph",
            "inputs": self.inputs_json(),
            "notes": self.notes,
            "exec": self.stepper.to_json(),
        }  # fmt: skip

    def inputs_json(self) -> dict[str, Any]:
        return {
            "source": self.input_source,
            "version": self.version,
            "tensors": [
                {"name": k, "shape": list(v.shape), "dtype": str(v.dtype)}
                for k, v in self.feeds.items()
            ],
        }

    def graphs(self) -> dict[str, Any]:
        """Both graphs (see `graph_json`), the compiled one with provenance and precision."""
        return self._graphs.get(0, self._graphs_now)

    def _graphs_now(self) -> dict[str, Any]:
        compiled = graph_json(self.main.model, self._describe_compiled)
        precision = {}
        for node in compiled["nodes"]:
            for name in node["origin"]:
                precision.setdefault(name, set()).add(node["precision"])
        base = self.reference.precision if self.reference else self.main.precision
        original = graph_json(
            self.original,
            lambda node: {"precision": "/".join(sorted(precision.get(node.name, {base})))},
        )
        return {"original": original, "compiled": compiled, "same": self.main.kind == "model"}

    def _describe_compiled(self, node: ir.Node) -> dict[str, Any]:
        origin = self.main.origin(node)
        extra = {
            "origin": origin["origin"],
            "passes": origin["passes"],
            "precision": self.main.precision_of(node),
        }
        if origin["passes"] or not scope_of(node.name or ""):  # made by a pass: its origins'
            extra["scope"] = shared_scope(origin["origin"])
        return extra

    def _compiled_of_original(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for node in topological(self.main.model):
            for name in self.main.origin(node)["origin"]:
                out.setdefault(name, []).append(node.name)
        return out

    # ---- one node, as the panel shows it ---------------------------------------------------

    def node(self, pane: str, name: str) -> dict[str, Any]:
        """A node's provenance, precision, tensors, error, kernels and findings; parts not
        computed yet (the comparison, the profile) are listed under `pending`."""
        if pane not in PANES:
            raise KilnError(f"pane '{pane}': use one of {', '.join(PANES)}.")
        nodes = self._nodes if pane == "compiled" else self._original_nodes
        node = nodes.get(name)
        if node is None:
            raise KilnError(f"no node '{name}' in the {pane} graph.")
        data: dict[str, Any] = {
            "pane": pane,
            "name": name,
            "op": op_name(node),
            "scope": self._describe_compiled(node).get("scope", scope_of(name))
            if pane == "compiled"
            else scope_of(name),
            "inputs": [value_json(v) for v in node.inputs],
            "outputs": [value_json(v) for v in node.outputs if v.name],
            "attributes": attributes_json(node),
        }
        compiled = [name] if pane == "compiled" else self._counterparts.get(name, [])
        if pane == "compiled":
            origin = self.main.origin(node)
            data.update(origin=origin["origin"], passes=origin["passes"])
        data["compiled"] = [self._compiled_brief(c) for c in compiled]
        data["precision"] = "/".join(sorted({self.main.precision_of(self._nodes[c])
                                             for c in compiled})) or None  # fmt: skip
        data.update(self._measured(pane, name))
        return data

    def _compiled_brief(self, name: str) -> dict[str, Any]:
        node = self._nodes[name]
        origin = self.main.origin(node)
        return {
            "name": name,
            "op": op_name(node),
            "origin": origin["origin"],
            "passes": origin["passes"],
            "precision": self.main.precision_of(node),
            "breakpoint": name in self.stepper.breakpoints,
            "ran": self.stepper.ran(name),
        }

    def _measured(self, pane: str, name: str) -> dict[str, Any]:
        """Error rows, kernels and findings of a node, from what is computed already."""
        out: dict[str, Any] = {"pending": []}
        comparison = self._comparison.peek(self.version)
        if self.reference is not None and comparison is None:
            out["pending"].append("comparison")
        elif comparison is not None:
            key = (lambda r: (r["b"] or {}).get("node")) if pane == "compiled" else (
                lambda r: r["node"])  # fmt: skip
            out["errors"] = [row for row in comparison["layers"] if key(row) == name]
            first = comparison["first_divergence_row"]
            out["first_divergence"] = first is not None and key(first) == name
        profile = self._profile.peek(0)
        if self._profiles() and profile is None:
            out["pending"].append("profile")
        elif profile is not None and profile.get("available"):
            field = "graph_nodes" if pane == "compiled" else "original"
            kernels = [k for k in profile["kernels"] if name in k.get(field, [])]
            names = {k["name"] for k in kernels}
            out["kernels"] = kernels
            out["findings"] = [f for f in profile["findings"] if names & set(f["kernels"])]
        return out

    # ---- execution ---------------------------------------------------------------------------

    def execute(self, action: str) -> dict[str, Any]:
        """`step`, `run` (to the first breakpoint), `continue` or `reset`; the nodes that ran."""
        actions = {"step": "step", "run": "run", "continue": "resume", "reset": "reset"}
        if action not in actions:
            raise KilnError(f"unknown action '{action}': use one of {', '.join(actions)}.")
        if action != "reset":
            self._ran("main")  # the one run everything is revealed from (an engine error: here)
        with self._lock:
            ran = getattr(self.stepper, actions[action])() or []
            return {**self.stepper.to_json(), "ran": ran}

    def set_breakpoint(self, node: str, on: bool) -> dict[str, Any]:
        with self._lock:
            self.stepper.set_breakpoint(node, on)
            return self.stepper.to_json()

    def _ran(self, side: str) -> dict[str, Any]:
        """Every tensor `side` computes on the current inputs, from one exposed run."""
        chosen = self._side(side)
        version, feeds = self.version, self.feeds
        names = [v.name for node in chosen.model.graph for v in node.outputs if v.name]
        return self._runs[side].get(version, lambda: run_exposed(chosen, names, feeds))

    # ---- tensors -----------------------------------------------------------------------------

    def tensor(self, name: str, side: str = "main", index: str | None = None) -> dict[str, Any]:
        """Shape, dtype, statistics, histogram and a slice of one tensor, or why there is none
        yet (`available`: false)."""
        array, why = self._array(name, side)
        if array is None:
            return {"name": name, "side": side, "available": False, "why": why}
        return {**tensor_json(name, array, index), "side": side, "available": True}

    def tensor_npy(self, name: str, side: str = "main") -> bytes:
        array, why = self._array(name, side)
        if array is None:
            raise KilnError(f"tensor '{name}': {why}")
        return to_npy(array)

    def _array(self, name: str, side: str) -> tuple[Any, str]:
        chosen = self._side(side)
        if name in self.feeds:
            return self.feeds[name], ""
        weight = chosen.model.graph.initializers.get(name)
        if weight is not None and weight.const_value is not None:
            return weight.const_value.numpy(), ""
        producer = chosen.producer(name)
        if producer is None:  # fused inside a kernel, or never in this graph: not invented
            return None, f"{chosen.spec} computes no tensor '{name}'"
        if side == "main" and not self.stepper.ran(producer.name):
            return None, f"not computed yet: {producer.name} has not run (step or run to it)"
        value = self._ran(side).get(name)
        if value is None:
            return None, f"{chosen.engine} did not return '{name}' from the exposed run"
        return value, ""

    def _side(self, side: str) -> Side:
        if side not in SIDES:
            raise KilnError(f"side '{side}': use main or against.")
        if side == "main":
            return self.main
        if self.reference is None:
            raise KilnError("there is no other side: start kiln debug with --against B.")
        return self.reference

    # ---- inputs ------------------------------------------------------------------------------

    def _first_feeds(self, inputs: str | None) -> tuple[dict[str, np.ndarray], str]:
        from kiln.ir.inputs import read_inputs

        if inputs is not None:
            feeds, source = read_inputs(inputs, self.original), inputs
        else:
            feeds, source = self._synthesized()
        self._check(feeds, source)
        return feeds, source

    def _synthesized(self, seed: int = 0) -> tuple[dict[str, np.ndarray], str]:
        return synthesized_feeds(self.original, (self.main, self.against), self.shapes, seed)

    def _check(self, feeds: dict[str, np.ndarray], where: str) -> None:
        from kiln.ir.inputs import check_feeds

        for side in (self.main, self.reference):
            if side is not None:
                check_feeds(side.model, feeds, where=f"{where} (for {side.spec})")
        _check_dims(self.original, feeds, where)

    def set_inputs(self, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        """Replace some inputs (checked against both sides); execution starts over."""
        feeds = {**self.feeds, **arrays}
        self._check(feeds, "the new inputs")
        return self._use(feeds, "edited")

    def reseed(self, seed: int) -> dict[str, Any]:
        """Synthesized inputs from another seed; execution starts over."""
        feeds, _ = self._synthesized(seed)
        self._check(feeds, f"seed {seed}")
        return self._use(feeds, f"synthesized (seed {seed})")

    def _use(self, feeds: dict[str, np.ndarray], source: str) -> dict[str, Any]:
        with self._lock:
            self.feeds, self.input_source = feeds, source
            self.version += 1
            self.stepper.reset()
        return self.inputs_json()

    # ---- comparison and profile --------------------------------------------------------------

    def comparison(self) -> dict[str, Any]:
        """The layer-wise comparison of main against the reference on the current inputs,
        with each pane's per-node error; `available`: false without a reference."""
        if self.reference is None:
            return {
                "available": False,
                "why": f"{self.main.spec} is the original: give --against B for errors",
            }
        version, feeds = self.version, self.feeds
        return self._comparison.get(version, lambda: self._compare(feeds))

    def _compare(self, feeds: dict[str, np.ndarray]) -> dict[str, Any]:
        assert self.reference is not None
        result = compare_sides(self.reference, self.main, feeds=dict(feeds), shapes=self.shapes)
        data = result.to_json()
        # the sides' own notes (an original changed since) are the session's: said once
        data["notes"] = [note for note in data["notes"] if note not in self.notes]
        metric = data["budget"]["metric"]
        first = data["first_divergence_row"]
        data.update(
            available=True,
            errors={
                "original": _errors(data["layers"], lambda r: r["node"], metric),
                "compiled": _errors(data["layers"], lambda r: (r["b"] or {}).get("node"), metric),
            },
            first_compiled=(first["b"] or {}).get("node") if first else None,
        )
        return data

    def _profiles(self) -> bool:
        return self.profile_runs > 0 and self.main.kind != "build"

    def profile(self) -> dict[str, Any]:
        """Kernels, per-node milliseconds, the timeline and findings (`kiln.profile`), measured
        once per session; `available`: false where it cannot or should not run."""
        if self.profile_runs <= 0:
            return {"available": False, "why": "profiling is off (--profile-runs 0)"}
        if self.main.kind == "build":
            return {
                "available": False,
                "why": f"{self.main.spec} is compiled in memory; write it with kiln optimize "
                "-o OUT.kiln and debug OUT.kiln for kernel times",
            }
        return self._profile.get(0, self._profile_now)

    def _profile_now(self) -> dict[str, Any]:
        from kiln.profile import profile_model

        runs = self.profile_runs
        result = profile_model(self.main.spec, runs=runs, rounds=min(2, runs), peaks=self.peaks)
        return profile_view(result)


def _original_graph(main: Side, against: Side | None) -> ir.Model:
    for side in (main, against):
        if side is not None and side.original is not None:
            return side.original
    raise KilnError(
        f"{main.missing}: the original graph is needed to show where each node came from. "
        "Restore it, or give the original with --against ORIGINAL.onnx."
    )


def _check_dims(model: ir.Model, feeds: dict[str, np.ndarray], where: str) -> None:
    """A named dim (batch, seq) takes one value in every input that has it."""
    seen: dict[str, tuple[int, str]] = {}
    for value in model.graph.inputs:
        if value.name not in feeds or value.shape is None:
            continue
        for dim, size in zip(value.shape, np.shape(feeds[value.name]), strict=False):
            if isinstance(dim, int) or not dim.value:
                continue
            first = seen.setdefault(str(dim.value), (int(size), value.name))
            if first[0] != size:
                raise KilnError(
                    f"{where}: input '{value.name}' has {dim.value}={size} but '{first[1]}' has "
                    f"{dim.value}={first[0]}; a named dim takes one value in every input."
                )


def _reference(main: Side) -> Side | None:
    """A compiled side's original, run as every compile is verified against it."""
    if main.kind == "model" or main.original is None:
        return None
    from kiln.compiler.reference import REFERENCE_OPTIONS

    return Side(
        spec="the original",
        kind="model",
        model=main.original,
        engine="ort",
        options=REFERENCE_OPTIONS,
        precision="fp32",
        original=main.original,
    )


def _errors(
    rows: list[dict[str, Any]], key: Callable[[dict[str, Any]], str | None], metric: str
) -> dict[str, dict[str, Any]]:
    """Each node's worst compared tensor: 1 − cosine under a cosine budget, else max abs."""
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        node = key(row)
        if node is None:
            continue
        value = row["max_abs"]
        if metric == "cosine" and row["cosine"] is not None:
            value = 1.0 - row["cosine"]
        value = float(value) if value is not None and np.isfinite(value) else float("inf")
        entry = out.setdefault(node, {"value": value, "ok": True})
        entry["value"] = max(entry["value"], value)
        entry["ok"] = entry["ok"] and bool(row["ok"])
    return out
