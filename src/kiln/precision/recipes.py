"""Hand recipes: what a user gets from an engine's own tools with their defaults on the original
graph, as Kiln's candidates, so that Kiln's pick is never behind one a user could run by hand.

int8 on OpenVINO: `nncf.quantize` (`ModelType.TRANSFORMER` — SmoothQuant and its ignored
patterns — for MatMul-heavy models, its defaults for Conv-heavy ones). int8 on ONNX Runtime:
`quantize_dynamic` defaults for MatMul-heavy models, `quantize_static` defaults (QDQ, MinMax,
per-tensor weights) for Conv-heavy ones. bf16 on OpenVINO: its default inference precision,
where the CPU has bf16 kernels. These are exactly the peers `kiln bench` runs by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from kiln.config import HAND, RECIPES
from kiln.errors import KilnError
from kiln.precision.bf16 import no_bf16_kernels
from kiln.precision.sensitivity import conv_heavy


@dataclass(frozen=True)
class Recipe:
    """One hand recipe: its name (a CompileConfig.recipe), what a user runs, and whether it
    calibrates activations on samples."""

    name: str
    tool: str
    static: bool

    @property
    def engine(self) -> str:
        return RECIPES[self.name][0]

    @property
    def precision(self) -> str:
        return RECIPES[self.name][1]


TOOLS = {
    "nncf-transformer": Recipe(
        "nncf-transformer", "nncf.quantize, ModelType.TRANSFORMER preset", static=True
    ),
    "nncf-default": Recipe("nncf-default", "nncf.quantize defaults", static=True),
    "ort-dynamic": Recipe("ort-dynamic", "onnxruntime quantize_dynamic defaults", static=False),
    "ort-static": Recipe(
        "ort-static", "onnxruntime quantize_static defaults (QDQ, MinMax)", static=True
    ),
    "openvino-bf16": Recipe(
        "openvino-bf16", "OpenVINO's default inference precision (bf16)", static=False
    ),
}
# Which recipe a user picks by hand, per engine and precision: (for transformers, for CNNs).
BY_HAND = {
    ("openvino", "int8"): ("nncf-transformer", "nncf-default"),
    ("ort", "int8"): ("ort-dynamic", "ort-static"),
    ("openvino", "bf16"): ("openvino-bf16", "openvino-bf16"),
}


def has_hand_recipe(engine: str, precision: str) -> bool:
    """Whether a user could run `engine` at `precision` by hand here: bf16 only where the
    engine has bf16 kernels on this CPU (elsewhere it is not bf16 at all)."""
    if (engine, precision) not in BY_HAND:
        return False
    return precision != "bf16" or no_bf16_kernels(engine) is None


def hand_recipe(model: ir.Model, engine: str, precision: str) -> str:
    """The recipe a user would run for `model` on `engine` at `precision`."""
    if (engine, precision) not in BY_HAND:
        raise KilnError(
            f"no hand recipe runs {engine} at {precision}; hand recipes are "
            f"{', '.join(f'{e} {p}' for e, p in BY_HAND)}."
        )
    transformer, cnn = BY_HAND[engine, precision]
    return cnn if conv_heavy(model) else transformer


def resolve_recipe(recipe: str, model: ir.Model, engine: str, precision: str) -> Recipe:
    """`recipe` as the compile runs it: HAND becomes the model's own."""
    name = hand_recipe(model, engine, precision) if recipe == HAND else recipe
    return TOOLS[name]
