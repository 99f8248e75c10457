"""Options a compile was given and did not use, said in words: an option that silently does
nothing reads as one that worked."""

from __future__ import annotations

from kiln.config import CompileConfig
from kiln.precision import QUANTIZED

DEFAULTS = CompileConfig()


def unused_options(config: CompileConfig, static: bool) -> list[str]:
    """One line per option of `config` (a concrete candidate) that has no effect on it;
    `static`: whether its int8 calibrates activations (static QDQ) or not (dynamic)."""
    precision, notes = config.precision, []
    quantized = precision in QUANTIZED
    if config.calib and not quantized:
        notes.append(f"--calib not used: {precision} needs no calibration samples")
    method_set = config.calib_method != DEFAULTS.calib_method
    if method_set and not quantized:
        notes.append(f"--calib-method not used: {precision} needs no calibration")
    elif method_set and not static:
        notes.append(
            f"--calib-method not used: {precision} here is dynamic (weights quantized ahead, "
            "activation scales computed at run time), so nothing is calibrated"
        )
    if config.block_size != DEFAULTS.block_size and precision != "int4":
        notes.append("--block-size not used: only int4 quantizes weights in blocks")
    budget_set = (config.metric, config.max_drop) != (DEFAULTS.metric, DEFAULTS.max_drop)
    if budget_set and precision == "fp32":
        notes.append(
            "--metric/--max-drop not used: fp32 is lossless, checked against the original "
            "within fp32 tolerance, not an accuracy budget"
        )
    if config.static and not config.verify:
        notes.append("--static not used: it fixes the dims of the inputs verified on, and "
                     "--no-verify runs none")  # fmt: skip
    return notes
