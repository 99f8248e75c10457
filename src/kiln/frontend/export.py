"""torch → ONNX through torch.onnx's dynamo exporter (torch.export underneath).

The exporter keeps, on every ONNX node, the module scopes and the Python stack it was traced
from (`pkg.torch.onnx.*` metadata); `kiln.ir.provenance` turns them into Kiln's provenance.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import warnings
from collections.abc import Iterator
from typing import Any

import onnx

from kiln.errors import KilnError, a_type
from kiln.frontend.torch_import import require_torch

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RAISED_AT = re.compile(r'The following call raised this error:\s*File "([^"]+)", line (\d+)')
DATA_DEPENDENT_HINT = (
    "A branch on a tensor's values (data-dependent control flow) cannot be exported: compute "
    "both sides and pick with torch.where, use torch.cond, or branch on shapes only."
)


def to_onnx(
    module_or_program: Any,
    example_inputs: Any = None,
    *,
    dynamic_shapes: Any = None,
) -> onnx.ModelProto:
    """The ONNX model `torch.onnx.export(..., dynamo=True)` makes of a torch.nn.Module, traced
    on `example_inputs` (a tuple of positional arguments, one tensor, or a dict of keyword
    arguments) with `dynamic_shapes` as torch.export takes them (`{0: "batch"}` names a dim),
    or of a torch.export.ExportedProgram, which carries its own. A module is exported in eval
    mode. Raises KilnError, naming the module and torch's reason, when it does not export."""
    torch = require_torch("exporting a PyTorch model")
    what = describe(module_or_program)
    if isinstance(module_or_program, torch.export.ExportedProgram):
        # torch.onnx renames a program's dims only when told the names (else they stay `s77`)
        args, kwargs, dynamic_shapes = (), None, program_dims(module_or_program)
    elif isinstance(module_or_program, torch.nn.Module):
        args, kwargs = split_example(example_inputs, what)
    else:
        raise KilnError(
            f"cannot export {a_type(module_or_program)}: give a torch.nn.Module or a "
            "torch.export.ExportedProgram."
        )
    with eval_mode(module_or_program), quiet():
        try:
            return _export(module_or_program, args, kwargs, dynamic_shapes).model_proto
        except Exception as exc:  # torch's own error types vary by release and step
            blame = _blame(module_or_program, args, kwargs, dynamic_shapes, exc)
            raise KilnError(blame or export_failure(what, exc)) from None


def _export(model: Any, args: tuple, kwargs: dict | None, dynamic_shapes: Any) -> Any:
    torch = require_torch("exporting a PyTorch model")
    return torch.onnx.export(
        model, args, kwargs=kwargs, dynamic_shapes=dynamic_shapes, dynamo=True, verbose=False
    )


def _blame(
    model: Any, args: tuple, kwargs: dict | None, dynamic_shapes: Any, failure: BaseException
) -> str | None:
    """After a failed export, the argument at fault when it is not the module: the example
    inputs when the module cannot even run on them, `dynamic_shapes` when the module exports
    without it. None: the module itself is what torch.export refuses. (Only on the error path:
    a second export costs what the first did.)"""
    torch = require_torch("exporting a PyTorch model")
    if not isinstance(model, torch.nn.Module):
        return None
    what = describe(model)
    try:
        with torch.no_grad():
            model(*args, **(kwargs or {}))
    except Exception as exc:  # whatever the module raises on inputs it cannot take
        return (
            f"{what}: example_inputs do not fit the module (calling it on them raised "
            f"{type(exc).__name__}: {_reason(exc)}). Give the inputs its forward takes (a "
            "tuple of positional arguments, one tensor, or a dict of keyword arguments). "
            "Nothing was written."
        )
    if dynamic_shapes is None:
        return None
    try:
        _export(model, args, kwargs, None)
    except Exception:  # the module fails either way: its own fault, reported as such
        return None
    return (
        f"{what}: dynamic_shapes {dynamic_shapes!r} does not fit the module, which exports "
        f"without it ({_reason(_root(failure))}). Mark only dims that vary, "
        "one {axis: name} per input in forward's order, e.g. ({0: 'batch'},). Nothing was "
        "written."
    )


def program_dims(program: Any) -> list[dict[int, str]]:
    """Per tensor input of an ExportedProgram (the ONNX graph's inputs, in order), its dynamic
    axes by name: the torch.export.Dim name where this process still knows it (a program
    exported here), else `batch` for the first leading dim and `INPUT_dimK` for the rest.
    torch.export.save keeps no names (torch 2.13: a loaded .pt2 knows only `s77`), so a
    loaded program gets the fallback names; one symbol keeps one name across inputs."""
    torch = require_torch("exporting a PyTorch model")
    known = _dim_names(program)
    names: dict[str, str] = {}  # symbol → name
    dims: list[dict[int, str]] = []
    user = set(program.graph_signature.user_inputs)
    for node in program.graph.nodes:
        value = node.meta.get("val")
        if node.op != "placeholder" or node.name not in user:
            continue
        if not isinstance(value, torch.Tensor):
            continue  # a Python number or None: not an ONNX graph input
        axes: dict[int, str] = {}
        for axis, size in enumerate(value.shape):
            symbol = str(size.node.expr) if isinstance(size, torch.SymInt) else ""
            if not symbol.isidentifier():  # static, or derived (`2*s77`) from a named one
                continue
            if symbol not in names:
                taken = set(names.values())
                wanted = known.get(symbol) or ("batch" if axis == 0 else "")
                names[symbol] = (
                    wanted if wanted and wanted not in taken else f"{node.name}_dim{axis}"
                )
            axes[axis] = names[symbol]
        dims.append(axes)
    return dims


def _dim_names(program: Any) -> dict[str, str]:
    """symbol → the name of the torch.export.Dim it came from, from the shape environment a
    program exported in this process keeps (torch's own, unpublished: anything unexpected
    gives no names, and the fallback names apply)."""
    try:
        env = next(
            node.meta["val"].fake_mode.shape_env
            for node in program.graph.nodes
            if node.op == "placeholder" and getattr(node.meta.get("val"), "fake_mode", None)
        )
        debug = env.source_name_to_debug_name
        names = {}
        for symbol, sources in env.var_to_sources.items():
            for source in sources:
                key = source.name() if callable(source.name) else source.name
                if key in debug:
                    names[str(symbol)] = str(debug[key])
        return names
    except Exception:  # private API: any change of it means "no names", not a failure
        return {}


def describe(model: Any) -> str:
    """How messages name a model: its class (`BertModel`)."""
    name = type(model).__name__
    return "a torch.export program" if name == "ExportedProgram" else name


def split_example(example_inputs: Any, what: str) -> tuple[tuple, dict | None]:
    """(positional arguments, keyword arguments) from what the user gave."""
    torch = require_torch("exporting a PyTorch model")
    if example_inputs is None:
        raise KilnError(
            f"{what}: exporting a module needs example inputs to trace it on, e.g. "
            "kiln.compile(module, example_inputs=(torch.randn(1, 3, 224, 224),))."
        )
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), None
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, tuple | list):
        return tuple(example_inputs), None
    raise KilnError(
        f"{what}: example_inputs is {a_type(example_inputs)}; give a tuple of the "
        "module's positional arguments, one tensor, or a dict of keyword arguments."
    )


@contextlib.contextmanager
def eval_mode(model: Any) -> Iterator[None]:
    """A module in eval mode for the duration (an artifact is for inference: dropout off,
    batch-norm on its running statistics); its own mode is restored afterwards."""
    if not getattr(model, "training", False):  # a program, or a module in eval mode already
        yield
        return
    model.eval()
    try:
        yield
    finally:
        model.train(True)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The exporter's progress lines and warnings kept off the user's terminal (and off
    `--json` output); its errors still come through as KilnError. torch logs through
    handlers that hold the real stderr, so logging is switched off, not redirected."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


def _root(exc: BaseException) -> BaseException:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def _reason(exc: BaseException) -> str:
    """The first non-empty line of an exception's message, colours removed, at most 200
    characters, without a closing full stop."""
    text = _ANSI.sub("", str(exc))
    reason = next((line.strip() for line in text.splitlines() if line.strip()), "")
    reason = reason if len(reason) <= 200 else reason[:200] + "..."
    return reason.rstrip(".") or type(exc).__name__


def export_failure(what: str, exc: BaseException) -> str:
    """One line: which module, torch's reason (its first line), where in the user's code."""
    root = _root(exc)
    text = _ANSI.sub("", str(root))
    reason = _reason(root)
    where = _RAISED_AT.search(text)
    at = f" at {where.group(1)}:{where.group(2)}" if where else ""
    converting = "Conversion" in type(exc).__name__
    step = (
        "torch.onnx cannot translate it to ONNX" if converting else "torch.export cannot export it"
    )
    data_dependent = "DataDependent" in type(root).__name__ or "data-dependent" in reason
    hint = DATA_DEPENDENT_HINT if data_dependent else "Fix the module so torch.export takes it."
    kind = type(root).__name__
    return f"{what}: {step}{at} ({kind}: {reason}). {hint} Nothing was written."
