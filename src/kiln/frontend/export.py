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

from kiln.errors import KilnError
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
        args, kwargs, dynamic_shapes = (), None, None
    elif isinstance(module_or_program, torch.nn.Module):
        args, kwargs = split_example(example_inputs, what)
    else:
        raise KilnError(
            f"cannot export a {type(module_or_program).__name__}: give a torch.nn.Module or a "
            "torch.export.ExportedProgram."
        )
    with eval_mode(module_or_program), _quiet():
        try:
            program = torch.onnx.export(
                module_or_program, args, kwargs=kwargs, dynamic_shapes=dynamic_shapes,
                dynamo=True, verbose=False,
            )  # fmt: skip
        except Exception as exc:  # torch's own error types vary by release and step
            raise KilnError(export_failure(what, exc)) from None
    return program.model_proto


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
        f"{what}: example_inputs is a {type(example_inputs).__name__}; give a tuple of the "
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
def _quiet() -> Iterator[None]:
    """The exporter's progress lines and warnings kept off the user's terminal (and off
    `--json` output); its errors still come through as KilnError."""
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


def export_failure(what: str, exc: BaseException) -> str:
    """One line: which module, torch's reason (its first line), where in the user's code."""
    root = exc
    while root.__cause__ is not None:
        root = root.__cause__
    text = _ANSI.sub("", str(root))
    reason = next((line.strip() for line in text.splitlines() if line.strip()), "")
    reason = reason if len(reason) <= 200 else reason[:200] + "..."
    where = _RAISED_AT.search(text)
    at = f" at {where.group(1)}:{where.group(2)}" if where else ""
    converting = "Conversion" in type(exc).__name__
    step = (
        "torch.onnx cannot translate it to ONNX" if converting else "torch.export cannot export it"
    )
    data_dependent = "DataDependent" in type(root).__name__ or "data-dependent" in reason
    hint = DATA_DEPENDENT_HINT if data_dependent else "Fix the module so torch.export takes it."
    kind = type(root).__name__
    return f"{what}: {step}{at} ({kind}: {reason.rstrip('.')}). {hint} Nothing was written."
