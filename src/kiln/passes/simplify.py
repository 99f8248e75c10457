"""Simplification: constant folding, dead code, CSE, identity and no-op removal."""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes.common as common
from onnxscript import rewriter
from onnxscript.rewriter.ort_fusions import shape_optimization

from kiln.ir import onnxscript_internals as internals
from kiln.ir.provenance import all_nodes
from kiln.passes.base import KilnPass, ModelState
from kiln.passes.scopes import ScopedIdentityEliminationPass

# Folding bigger tensors than this would bloat the file with precomputed weights.
FOLD_OUTPUT_LIMIT = 1 << 20
# Conv-affine rewrites belong to the fusion stage, where they are counted and bisected alone.
_FUSION_RULES = {
    id(r) for r in (*internals.FUSE_BATCHNORM_RULES, *internals.FUSE_PAD_INTO_CONV_RULES)
}
SIMPLIFY_RULES = [r for r in internals.DEFAULT_REWRITE_RULES if id(r) not in _FUSION_RULES]

internals.guard_split_to_sequence()


def simplify(model: ir.Model, iterations: int = 2) -> None:
    """onnxscript's optimizer loop, minus its conv fusions, then the usual tidy-up.

    Every step reaches If/Loop/Scan bodies (the folder, the rewriter, dead-code removal and
    identity elimination walk them; CSE skips control-flow nodes and leaves bodies as they
    are) and keeps each body's outputs made inside it."""
    loop = ir.passes.PassManager(
        [
            internals.FoldConstantsPass(
                shape_inference=True,
                input_size_limit=internals.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
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
        # onnx_ir's IdentityEliminationPass would strip If/Loop bodies of their outputs.
        ScopedIdentityEliminationPass(),
        common.OutputFixPass(),
    )(model)


class SimplifyPass(KilnPass):
    """Guarantee: outputs unchanged (exact up to fp32 rounding of folded constants).

    Folds constants, removes dead nodes, identities, no-op casts/reshapes/transposes and
    common subexpressions, inlines local functions, and resolves shape computations
    that are static. Weights stored as Constant nodes become initializers. Control flow and
    ops of other domains are carried through; what cannot be reasoned about is left as is.
    Reaches If/Loop/Scan bodies, whose outputs stay made inside them (an Identity forwarding
    an outer value to a body output stays).
    """

    name = "simplify"
    stage = "simplify"
    summary = "Constant folding, dead code, CSE, identity and no-op removal (onnxscript)."

    def apply(self, model: ir.Model) -> int:
        """Nodes folded, removed, replaced or rewired (not the node-count delta: folding a
        node into a constant keeps the count)."""
        before = ModelState.of(model)
        common.ShapeInferencePass()(model)
        simplify(model)
        shape_optimization.rules.apply_to_model(model)
        simplify(model)
        return before.rewritten_nodes(ModelState.of(model))


class CleanupPass(KilnPass):
    """Guarantee: outputs unchanged. Inlines helper functions that fusions left behind, drops
    dead code and re-infers shapes so engines see typed values. Reaches If/Loop/Scan bodies,
    as `simplify` does."""

    name = "cleanup"
    stage = "memory"
    summary = "Inline fusion helpers, drop dead code, re-infer shapes."

    def apply(self, model: ir.Model) -> int:
        """Nodes inlined, removed, replaced or rewired."""
        before = ModelState.of(model)
        simplify(model, iterations=1)
        common.ShapeInferencePass()(model)
        return before.rewritten_nodes(ModelState.of(model))


def count_nodes(model: ir.Model) -> int:
    return sum(1 for _ in all_nodes(model.graph))
