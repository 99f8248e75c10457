"""The private parts of onnxscript that Kiln uses, fenced into one module.

Kiln builds on onnxscript's optimizer and rewriter (docs/contributing/architecture.md), and
some of what it needs is only reachable through underscore modules and names: rule sets that
are not exported, the constant folder's pass and registry, the rewriter's metadata merger,
`get_numpy_value`. Those can change in any onnxscript release. This module is the only place in
Kiln that touches them: every other module imports them from here under a public name (a test
enforces it), so an onnxscript upgrade breaks here, in one file, and nowhere else.

Tested with onnxscript 0.7.x (0.7.2); pyproject.toml pins ``onnxscript>=0.7,<0.8``. Raising
the upper bound means running the test suite against the new release and fixing this module.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir
from onnxscript import rewriter as _rewriter
from onnxscript.optimizer import _constant_folding
from onnxscript.rewriter import _ir_utils, _rewrite_rule, pattern
from onnxscript.rewriter.ort_fusions import mha_scale as _mha_scale
from onnxscript.rewriter.ort_fusions import sdpa_via_mha as _sdpa_via_mha
from onnxscript.rewriter.rules.common import (
    _fuse_batchnorm,
    _fuse_pad_into_conv,
    _matmul_add_to_gemm,
)
from onnxscript.rewriter.rules.fusion import _layer_norm

TESTED_RANGE = ">=0.7,<0.8"  # the onnxscript versions pyproject.toml allows

# ---------------------------------------------------------------------------- values
get_numpy_value: Callable[[ir.Value | None], np.ndarray | None] = _ir_utils.get_numpy_value
"""The constant a value holds as a numpy array, or None (not constant, or external data)."""

# ---------------------------------------------------------------------------- constant folding
FoldConstantsPass = _constant_folding.FoldConstantsPass
DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT: int = (
    _constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT
)

# ---------------------------------------------------------------------------- rule sets
DEFAULT_REWRITE_RULES: tuple[pattern.RewriteRule, ...] = tuple(_rewriter._DEFAULT_REWRITE_RULES)
"""The rules onnxscript's own optimizer applies (no-op removal, conv fusions, ...)."""
FUSE_BATCHNORM_RULES: pattern.RewriteRuleSet = _fuse_batchnorm.rules
FUSE_PAD_INTO_CONV_RULES: pattern.RewriteRuleSet = _fuse_pad_into_conv.rules
MATMUL_ADD_TO_GEMM_RULES: pattern.RewriteRuleSet = _matmul_add_to_gemm.rules
LAYER_NORMALIZATION_RULES: list[pattern.RewriteRule] = _layer_norm.layer_normalization_rules
MHA_SCALE_RULES: pattern.RewriteRuleSet = _mha_scale._mha_scale_rules
SDPA_VIA_MHA_RULES: pattern.RewriteRuleSet = _sdpa_via_mha._rules


# ---------------------------------------------------------------------------- hooks
def register_metadata_merger(key: str, merge: Callable[[str, str], str]) -> None:
    """Make the rewriter combine node metadata `key` with `merge` when a rule replaces nodes
    (the rewriter's own extension point; one merger per key, the last registration wins)."""
    _rewrite_rule._default_metadata_merger.mergers[key] = merge


def guard_split_to_sequence() -> None:
    """Work around an onnxscript (0.7.2) constant-folding crash. Idempotent.

    Its SplitToSequence folder reads `split_value.ndim` when `split` has no constant value and a
    static shape that is not 1-D (a scalar graph input, as in ONNX's node test
    `test_split_to_sequence_1`): AttributeError, and the whole compile fails. Such a node
    cannot be folded anyway, so it is left as it is; every other case goes to onnxscript.
    """
    for evaluator in _constant_folding.registry.op_evaluators.get(("", "SplitToSequence"), []):
        fold = evaluator.function
        if getattr(fold, "kiln_guarded", False):
            continue

        def guarded(node: ir.Node, op, state, fold=fold):
            split = node.inputs[1] if len(node.inputs) > 1 else None
            if (
                split is not None
                and _constant_folding._get_numpy_value(split) is None
                and split.shape is not None
                and split.shape.rank() != 1
            ):
                return None
            return fold(node, op, state)

        guarded.kiln_guarded = True  # type: ignore[attr-defined]
        evaluator.function = guarded


__all__ = [
    "DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT",
    "DEFAULT_REWRITE_RULES",
    "FUSE_BATCHNORM_RULES",
    "FUSE_PAD_INTO_CONV_RULES",
    "LAYER_NORMALIZATION_RULES",
    "MATMUL_ADD_TO_GEMM_RULES",
    "MHA_SCALE_RULES",
    "SDPA_VIA_MHA_RULES",
    "TESTED_RANGE",
    "FoldConstantsPass",
    "get_numpy_value",
    "guard_split_to_sequence",
    "register_metadata_merger",
]
