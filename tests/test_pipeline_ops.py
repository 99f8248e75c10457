"""Kiln's array functions for pipeline glue: each op's numpy result equals its ONNX graph's run
by ONNX Runtime (integers exactly, floats to float32 rounding), edge cases included; each
result remembers the chain that made it, and nothing else does."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from kiln.pipeline import ops

RNG = np.random.default_rng(7)


def _run(model, **feeds) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def _same_as_graph(result: np.ndarray, x: np.ndarray) -> None:
    trace = ops.trace_of(result)
    assert trace is not None and trace.root is x
    graph = _run(ops.chain_model(trace.steps, x.dtype, x.ndim), x=x)
    assert graph.shape == result.shape and graph.dtype == result.dtype
    if np.issubdtype(result.dtype, np.floating):
        scale = max(float(np.abs(result).max(initial=0.0)), 1.0)
        np.testing.assert_allclose(graph, result, rtol=0, atol=2e-6 * scale)
    else:
        np.testing.assert_array_equal(graph, result)


IMAGE = RNG.integers(0, 256, (17, 23, 3), dtype=np.uint8)
FLOATS = RNG.standard_normal((3, 17, 23)).astype(np.float32)


@pytest.mark.parametrize(
    ("x", "op"),
    [
        (IMAGE, lambda x: ops.normalize(x, [123.7, 116.3, 103.5], [58.4, 57.1, 57.4])),
        (IMAGE, lambda x: ops.normalize(x, 0.5, 0.5, scale=1 / 255)),
        (IMAGE, lambda x: ops.to_layout(x, "HWC", "CHW")),
        (IMAGE, lambda x: ops.to_layout(x, "HWC", "NCHW")),
        (IMAGE, lambda x: ops.resize(x, (9, 40), "linear")),
        (IMAGE, lambda x: ops.resize(x, (34, 11), "nearest")),
        (IMAGE, lambda x: ops.resize(x, (17, 23), "linear")),  # the same size: unchanged
        (IMAGE, lambda x: ops.resize(x, (1, 1), "linear")),
        (FLOATS, lambda x: ops.resize(x, (48, 7), "linear", layout="CHW")),
        (FLOATS[0], lambda x: ops.resize(x, (5, 50), "nearest", layout="HW")),
        (IMAGE, lambda x: ops.pad(x, [(1, 2), (0, 3), (0, 0)], 114)),
        (IMAGE, lambda x: ops.pad(x, [(0, 0)] * 3)),
        (IMAGE, lambda x: ops.letterbox(x, (32, 32), 114)),
        (IMAGE, lambda x: ops.letterbox(x, (48, 320), 0)),
        (FLOATS, lambda x: ops.softmax(x, axis=0)),
        (1e4 * FLOATS, lambda x: ops.softmax(x, axis=-1)),  # large logits: no overflow
        (FLOATS, lambda x: ops.argmax(x, axis=1)),
        (np.zeros((4, 5), np.float32), lambda x: ops.argmax(x, axis=-1)),  # ties: the first
        (FLOATS, lambda x: ops.ctc_greedy_decode(x, blank=0)),
        (FLOATS, lambda x: ops.ctc_greedy_decode(x, blank=22)),
        (
            IMAGE,
            lambda x: ops.to_layout(
                ops.normalize(ops.resize(x, (48, 64)), 0.5, 0.5, 1 / 255), "HWC", "NCHW"
            ),
        ),  # fmt: skip
    ],
)
def test_each_op_gives_what_its_onnx_graph_gives(x: np.ndarray, op) -> None:
    _same_as_graph(op(x), x)


def test_ctc_greedy_decode_drops_repeats_then_blanks() -> None:
    path = np.array([[0, 3, 3, 0, 3, 5, 5, 5, 0, 0], [0] * 10, [1, 2, 3, 4, 5, 6, 7, 8, 9, 1]])
    probs = np.eye(10, dtype=np.float32)[path]
    expected = [[3, 3, 5] + [-1] * 7, [-1] * 10, [1, 2, 3, 4, 5, 6, 7, 8, 9, 1]]
    np.testing.assert_array_equal(ops.ctc_greedy_decode(probs), expected)
    _same_as_graph(ops.ctc_greedy_decode(probs), probs)


def test_resize_follows_the_stated_convention() -> None:
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    # linear, half-pixel centres, clamped at the edges (OpenCV's INTER_LINEAR)
    np.testing.assert_allclose(ops.resize(x, (1, 8), "linear", "HW"),
                               [[0, 0.25, 0.75, 1.25, 1.75, 2.25, 2.75, 3]])  # fmt: skip
    # nearest, src = floor(dst · in / out) (OpenCV's INTER_NEAREST)
    np.testing.assert_array_equal(ops.resize(x, (1, 8), "nearest", "HW"),
                                  [[0, 0, 1, 1, 2, 2, 3, 3]])  # fmt: skip
    np.testing.assert_array_equal(ops.resize(x, (1, 3), "nearest", "HW"), [[0, 1, 2]])


@pytest.mark.parametrize("count", [0, 1, 40])
def test_nms_gives_what_onnx_nonmaxsuppression_gives(count: int) -> None:
    corners = RNG.uniform(0, 20, (count, 2, 2)).astype(np.float32)
    boxes = np.concatenate([corners[:, 0], corners[:, 0] + corners[:, 1] + 1], axis=1)
    boxes[::3] = boxes[::3][:, [2, 3, 0, 1]]  # corners given the other way round
    scores = RNG.permutation(count).astype(np.float32) / max(count, 1)  # no ties
    for iou, threshold in [(0.5, 0.0), (0.2, 0.3), (0.9, 0.95)]:
        kept = ops.nms(boxes, scores, iou, threshold)
        graph = _run(ops.nms_model(iou, threshold), boxes=boxes, scores=scores)
        np.testing.assert_array_equal(kept, graph)
        assert kept.dtype == np.int64


def test_a_result_remembers_its_chain_and_stays_a_plain_array() -> None:
    y = ops.argmax(ops.softmax(FLOATS, axis=0), axis=0)
    assert type(y) is np.ndarray
    trace = ops.trace_of(y)
    assert trace.root is FLOATS and [s[0] for s in trace.steps] == ["softmax", "argmax"]
    assert ops.trace_of(y + 0) is None and ops.trace_of(FLOATS) is None
    key = id(y)
    del y, trace
    assert key not in ops._TABLE, "the side table lets go of a result with the result"


def test_an_op_on_a_folded_output_takes_the_folded_value_or_recovers_the_real_one() -> None:
    logits = FLOATS
    folded = ops.argmax(ops.softmax(logits, axis=0), axis=0)
    chain = ops.trace_of(folded).steps
    recovered = []

    def stand_in() -> np.ndarray:
        def recover() -> np.ndarray:
            recovered.append(1)
            return logits

        pending = ops.Pending(chain, folded, recover)
        placeholder = np.empty(0, np.float32)
        return ops.remember(placeholder, ops.Trace(placeholder, pending=pending))

    assert ops.argmax(ops.softmax(stand_in(), axis=0), axis=0) is folded and not recovered
    np.testing.assert_array_equal(ops.argmax(stand_in(), axis=2), np.argmax(logits, axis=2))
    np.testing.assert_allclose(
        ops.softmax(ops.softmax(stand_in(), axis=0), axis=1),
        ops.apply_steps(logits, [("softmax", (0,)), ("softmax", (1,))]),
    )
    assert len(recovered) == 2
