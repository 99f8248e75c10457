"""A PyTorch model as Kiln loads any model: exported, checked, fingerprinted, and carrying the
example inputs and the outputs PyTorch itself computed on them, for verification."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import KilnError
from kiln.frontend.export import describe, eval_mode, quiet, split_example, to_onnx
from kiln.frontend.torch_import import require_torch
from kiln.ir.inputs import check_feeds
from kiln.ir.load import Example, LoadedModel, load_any


def is_torch_model(model: Any) -> bool:
    """A torch.nn.Module or torch.export.ExportedProgram (without importing torch: a model
    of torch's can only exist once torch is imported)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    return isinstance(model, torch.nn.Module | torch.export.ExportedProgram)


def load_torch(model: Any, example_inputs: Any = None, dynamic_shapes: Any = None) -> LoadedModel:
    """A module (traced on `example_inputs`) or an ExportedProgram, exported to ONNX; the
    example's inputs and PyTorch's own outputs on them travel with it."""
    proto = to_onnx(model, example_inputs, dynamic_shapes=dynamic_shapes)
    name = describe(model)
    loaded = load_any(proto, source=f"<torch {name}>", name=name)
    loaded.example = _example(loaded, model, example_inputs)
    return loaded


def load_pt2(path: str | os.PathLike) -> LoadedModel:
    """A program saved with torch.export.save, exported to ONNX; its own example inputs (saved
    with it) and the program's outputs on them travel with it. The file keeps no
    torch.export.Dim names, so its dynamic dims are named as `program_dims` says (`batch`
    for the leading one)."""
    torch = require_torch(f"{path}: a saved torch.export program")
    if not Path(path).is_file():
        raise KilnError(f"{path}: no such file. Give a .pt2 saved with torch.export.save.")
    try:
        with quiet():  # torch logs a damaged archive's traceback before raising
            program = torch.export.load(str(path))
    except Exception as exc:  # a damaged archive raises whatever its reader met
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise KilnError(
            f"{path}: cannot be read as a torch.export program ({first}). Save it again with "
            "torch.export.save."
        ) from None
    loaded = load_any(to_onnx(program), source=str(path), name=Path(path).stem)
    loaded.example = _example(loaded, program, None)
    return loaded


def _example(loaded: LoadedModel, model: Any, example_inputs: Any) -> Example | None:
    """The example inputs by the ONNX model's input names, and PyTorch's outputs on them in
    the order of its outputs; None for a program saved without example inputs."""
    torch = require_torch("running a PyTorch model")
    from torch.utils import _pytree as pytree

    if isinstance(model, torch.export.ExportedProgram):
        if model.example_inputs is None:
            return None
        args, kwargs = model.example_inputs
        with torch.no_grad():  # the program as PyTorch runs it (its mode is fixed)
            outputs = model.module()(*args, **kwargs)
    else:
        args, kwargs = split_example(example_inputs, describe(model))
        with torch.no_grad(), eval_mode(model):
            outputs = model(*args, **(kwargs or {}))
    tensors = [t for t in pytree.tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
    results = [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor)]
    graph = loaded.model.graph
    names = [v.name for v in graph.inputs if v.name not in graph.initializers]
    if len(tensors) != len(names) or len(results) != len(graph.outputs):
        raise KilnError(
            f"{loaded.source}: the exported graph takes {len(names)} inputs and gives "
            f"{len(graph.outputs)} outputs, but the example holds {len(tensors)} input and "
            f"{len(results)} output tensors; they cannot be paired to verify the export."
        )
    feeds = {name: _numpy(t) for name, t in zip(names, tensors, strict=True)}
    check_feeds(loaded.model, feeds, where=f"{loaded.source} example inputs")
    return Example("torch", feeds, [_numpy(t) for t in results])


def _numpy(tensor: Any) -> np.ndarray:
    tensor = tensor.detach().cpu()
    if str(tensor.dtype) == "torch.bfloat16":  # numpy has no bfloat16
        tensor = tensor.float()
    return tensor.numpy()
