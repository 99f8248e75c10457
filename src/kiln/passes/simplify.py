"""Simplification: constant folding, dead code, CSE, identity and no-op removal."""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes.common as common
from onnxscript import rewriter
from onnxscript.optimizer import _constant_folding
from onnxscript.rewriter.ort_fusions import shape_optimization
from onnxscript.rewriter.rules.common import _fuse_batchnorm, _fuse_pad_into_conv

from kiln.ir.provenance import all_nodes
from kiln.passes.base import KilnPass

# Folding bigger tensors than this would bloat the file with precomputed weights.
FOLD_OUTPUT_LIMIT = 1 << 20
# Conv-affine rewrites belong to the fusion stage, where they are counted and bisected alone.
_FUSION_RULES = {id(r) for r in (*_fuse_batchnorm.rules, *_fuse_pad_into_conv.rules)}
SIMPLIFY_RULES = [r for r in rewriter._DEFAULT_REWRITE_RULES if id(r) not in _FUSION_RULES]


def _guard_split_to_sequence() -> None:
    """Work around an onnxscript (0.7.2) constant-folding crash.

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


_guard_split_to_sequence()


def simplify(model: ir.Model, iterations: int = 2) -> None:
    """onnxscript's optimizer loop, minus its conv fusions, then the usual tidy-up."""
    loop = ir.passes.PassManager(
        [
            _constant_folding.FoldConstantsPass(
                shape_inference=True,
                input_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
                output_size_limit=FOLD_OUTPUT_LIMIT,
            ),
            rewriter.RewritePass(SIMPLIFY_RULES),
            common.RemoveUnusedNodesPass(),
            common.RemoveUnusedFunctionsPass(),
            common.RemoveUnusedOpsetsPass(),
        ],
        steps=iterations,
        early_stop=True,
    )
    ir.passes.Sequential(
        common.InlinePass(),
        loop,
        common.RemoveUnusedNodesPass(),
        common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common.LiftSubgraphInitializersToMainGraphPass(),
        common.DeduplicateInitializersPass(),
        common.CommonSubexpressionEliminationPass(),
        common.IdentityEliminationPass(),
        common.OutputFixPass(),
    )(model)


class SimplifyPass(KilnPass):
    """Guarantee: outputs unchanged (exact up to fp32 rounding of folded constants).

    Folds constants, removes dead nodes, identities, no-op casts/reshapes/transposes and
    common subexpressions, inlines local functions, and resolves shape computations
    that are static. Weights stored as Constant nodes become initializers. Control flow and
    ops of other domains are carried through; what cannot be reasoned about is left as is.
    """

    name = "simplify"
    stage = "simplify"
    summary = "Constant folding, dead code, CSE, identity and no-op removal (onnxscript)."

    def apply(self, model: ir.Model) -> int:
        before = count_nodes(model)
        common.ShapeInferencePass()(model)
        simplify(model)
        shape_optimization.rules.apply_to_model(model)
        simplify(model)
        return max(before - count_nodes(model), 0)


class CleanupPass(KilnPass):
    """Guarantee: outputs unchanged. Inlines helper functions that fusions left behind, drops
    dead code and re-infers shapes so engines see typed values."""

    name = "cleanup"
    stage = "memory"
    summary = "Inline fusion helpers, drop dead code, re-infer shapes."

    def apply(self, model: ir.Model) -> int:
        before = count_nodes(model)
        simplify(model, iterations=1)
        common.ShapeInferencePass()(model)
        return max(before - count_nodes(model), 0)


def count_nodes(model: ir.Model) -> int:
    return sum(1 for _ in all_nodes(model.graph))
