"""kiln split: an edge part and a server part that compute the whole model within the codec's
budget, the cut chosen from the predictions, bad input refused with one line and nothing
written, and the edge session talking to a real `kiln serve` on loopback."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from test_serve import Server, _start, _stop

import kiln
from kiln.artifact import read_artifact
from kiln.errors import KilnError
from kiln.runtime import RemoteSession, SessionLike
from kiln.split.cuts import ALL_EDGE, ALL_SERVER, parse_bandwidth
from kiln.verify import cosine

MODEL = "zoo:resnet-tiny"
CUT = "layer2.0.Relu"  # a block's output: the skip connection has rejoined
OVERHEAD_MS = 0.5  # given, so that tests do not measure loopback
REQUESTS = 200  # the count; batches of 1-3


def _image(seed: int, batch: int = 1) -> dict[str, np.ndarray]:
    return {"input": np.random.default_rng(seed).random((batch, 3, 32, 32), dtype=np.float32)}


@pytest.fixture(scope="module")
def whole() -> kiln.Session:
    return kiln.Session(MODEL)


@pytest.fixture(scope="module")
def parts(tmp_path_factory, module_home) -> kiln.split.SplitResult:
    out = tmp_path_factory.mktemp("split") / "parts"
    return kiln.split(MODEL, at=CUT, output=out, codec="int8", overhead_ms=OVERHEAD_MS)


@pytest.fixture(scope="module")
def server(parts, module_home) -> Server:
    served = _start(module_home, str(parts.server_path), "--grpc-port", "-1")
    yield served
    _stop(served)


def test_edge_and_server_compute_the_whole_model_within_the_codec_budget(parts, whole) -> None:
    assert parts.chosen.cut.tensors == (CUT,) and parts.chosen.codec.label == "int8"
    assert parts.verification.ok and parts.chosen.wire_bytes < parts.chosen.raw_bytes
    edge, server = kiln.Session(parts.edge_path), kiln.Session(parts.server_path)
    assert edge.output_names == [i["name"] for i in parts.boundary]
    for seed in range(3):
        feeds = _image(seed, batch=2)
        wire = dict(zip(edge.output_names, edge.run(None, feeds), strict=True))
        got = server.run(None, {n: wire[n] for n in server.input_names})[0]
        assert cosine(whole.run(None, feeds)[0], got) >= 0.99
    manifest = json.loads((parts.edge_path / "manifest.json").read_text())["split"]
    assert manifest["server_model"] == "server" and manifest["cut"] == [CUT]
    assert manifest["codec"]["name"] == "int8" and manifest["verification"]["ok"]
    assert {c["kind"] for c in manifest["candidates"]} >= {ALL_SERVER, ALL_EDGE, "cut"}
    # A known manifest field: read back through the Manifest, and kept when it is rewritten.
    for path, role in ((parts.edge_path, "edge"), (parts.server_path, "server")):
        read = read_artifact(path).manifest
        assert read.split["role"] == role and read.to_json()["split"]["cut"] == [CUT]


def test_lossless_codec_matches_the_whole_model_to_fp32_tolerance(tmp_path, whole) -> None:
    result = kiln.split(MODEL, at="maxpool", output=tmp_path / "p", codec="none", overhead_ms=0.5)
    edge, server = kiln.Session(result.edge_path), kiln.Session(result.server_path)
    feeds = _image(7)
    middle = edge.run(None, feeds)[0]
    got = server.run(None, {"maxpool": middle})[0]
    np.testing.assert_allclose(got, whole.run(None, feeds)[0], atol=1e-4)
    assert result.chosen.wire_bytes == result.chosen.raw_bytes == middle.nbytes


def test_two_bandwidths_choose_different_cuts() -> None:
    """With an edge 8× slower, a fast link makes any node run on the edge a loss (its time
    grows 8× and the bytes cost next to nothing): all on the server. A link so slow that the
    answer alone takes longer than the whole model on the edge makes all on the edge win."""
    # No fixed cost per request: resnet-tiny runs in a tenth of a millisecond, under any
    # overhead, which would make all on the edge win at every bandwidth.
    fast = kiln.split(MODEL, bandwidth="100Gbit/s", edge_slowdown=8, overhead_ms=0.0)
    whole_edge_ms = next(p for p in fast.candidates if p.cut.kind == ALL_EDGE).edge_ms
    answer_bytes = fast.chosen.response_bytes
    slow_bps = answer_bytes * 8 / (whole_edge_ms * 10 / 1e3)  # the answer alone: 10× longer
    slow = kiln.split(MODEL, bandwidth=slow_bps, edge_slowdown=8, overhead_ms=OVERHEAD_MS)
    assert fast.chosen.cut.kind == ALL_SERVER
    assert slow.chosen.cut.kind == ALL_EDGE
    for result in (fast, slow):  # the choice is the table's least total among verified rows
        best = min(p.total_ms for p in result.candidates if p.verified is not False)
        assert result.chosen.total_ms == pytest.approx(best)


def test_bandwidths_parse_and_zero_is_refused() -> None:
    assert parse_bandwidth("20Mbit/s") == 20e6 and parse_bandwidth("1Gbit/s") == 1e9
    assert parse_bandwidth("200Mbit/s") == 200e6 and parse_bandwidth("5MB/s") == 40e6
    for bad in ("0Mbit/s", "fast", "20", "-1Mbit/s"):
        with pytest.raises(KilnError, match="--bandwidth"):
            parse_bandwidth(bad)


def _control_flow_model(path: Path) -> Path:
    """x → Relu → If(sum > 0) { then: Add(relu, 1) named 'inside' } → y."""
    one = helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])
    then = helper.make_graph(
        [helper.make_node("Add", ["relu", "one_c"], ["inside"], name="then_add")],
        "then", [], [helper.make_tensor_value_info("inside", TensorProto.FLOAT, [1, 4])],
        initializer=[helper.make_tensor("one_c", TensorProto.FLOAT, [], [1.0])],
    )  # fmt: skip
    other = helper.make_graph(
        [helper.make_node("Identity", ["relu"], ["outside"], name="else_id")],
        "else", [], [helper.make_tensor_value_info("outside", TensorProto.FLOAT, [1, 4])],
    )  # fmt: skip
    nodes = [
        helper.make_node("Relu", ["x"], ["relu"], name="relu"),
        helper.make_node("ReduceSum", ["relu"], ["total"], name="sum", keepdims=0),
        helper.make_node("Greater", ["total", "one"], ["cond"], name="greater"),
        helper.make_node("If", ["cond"], ["y"], name="branch", then_branch=then, else_branch=other),
    ]
    graph = helper.make_graph(
        nodes, "branchy", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], initializer=[one],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, path)
    return path


def _cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """`kiln ARGS` in this process (the CLI's own main, its exit code and its two streams)."""
    from kiln.cli import main

    monkeypatch.setattr(sys, "argv", ["kiln", *args])
    with pytest.raises(SystemExit) as exit_:
        main()
    out, err = capsys.readouterr()
    return int(exit_.value.code or 0), out, err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--at", "layer1.0.conv1"], "does not separate the graph"),
        (["--at", "inside"], "inside a control-flow body"),
        (["--bandwidth", "0Mbit/s"], "--bandwidth 0Mbit/s"),
        (["--bandwidth", "fast"], "--bandwidth fast"),
        (["--codec", "zip"], "--codec zip"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_nothing_written(
    tmp_path, monkeypatch, capsys, args, message
) -> None:
    model = _control_flow_model(tmp_path / "branchy.onnx") if "inside" in args else MODEL
    code, out, err = _cli(
        monkeypatch, capsys, "split", str(model), "-o", str(tmp_path / "d"), *args
    )
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == (
        ["branchy.onnx"] if "inside" in args else []
    )


def test_cli_writes_both_artifacts_and_json(tmp_path, monkeypatch, capsys) -> None:
    code, out, err = _cli(
        monkeypatch, capsys, "split", MODEL, "--at", "maxpool", "--codec", "fp16",
        "--bandwidth", "200Mbit/s", "--overhead-ms", "0.5", "-o", str(tmp_path / "d"), "--json",
    )  # fmt: skip
    assert code == 0, err
    data = json.loads(out)
    assert data["chosen"]["cut"] == ["maxpool"] and data["chosen"]["codec"] == "fp16"
    assert data["chosen"]["wire_bytes"] * 2 == data["chosen"]["raw_bytes"]
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["edge.kiln", "server.kiln"]
    assert [p.name for p in tmp_path.iterdir()] == ["d"]  # no temporary left beside it
    for part in ("edge.kiln", "server.kiln"):
        kiln.Session(tmp_path / "d" / part)  # ordinary artifacts


def test_edge_session_and_kiln_serve_answer_like_the_whole_model(parts, server, whole) -> None:
    with kiln.Session(parts.edge_path, remote=server.base, timeout=30) as remote:
        assert isinstance(remote, RemoteSession) and isinstance(remote, SessionLike)
        assert remote.output_names == whole.output_names
        for seed in range(REQUESTS):
            feeds = _image(seed, batch=1 + seed % 3)
            got = remote.run(None, feeds)[0]
            assert cosine(whole.run(None, feeds)[0], got) >= 0.99
        assert remote.bytes_sent > 0 and remote.bytes_received > 0


def test_a_server_part_served_under_its_own_name_behaves_as_a_session(
    parts, whole, tmp_path
) -> None:
    # Named, so that several splits' server parts share one server (here one part, twice).
    part = parts.server_path
    named = _start(tmp_path, f"tiny-tail={part}", f"other-tail={part}", "--grpc-port", "-1")
    assert [m["name"] for m in named.ready["models"]] == ["other-tail", "tiny-tail"]
    requests = [_image(seed, batch=1 + seed % 2) for seed in range(3)]
    try:
        with kiln.Session(
            parts.edge_path, remote=named.base, model_name="tiny-tail", timeout=30
        ) as remote:
            answers = remote.run_batch(requests)
            stats = remote.stats()
    finally:
        _stop(named)
    for feeds, outputs in zip(requests, answers, strict=True):
        assert cosine(whole.run(None, feeds)[0], outputs[0]) >= 0.99
    assert stats["requests"] == len(requests) and stats["whole"]["runs"] == len(requests)
    assert stats["remote"]["model"] == "tiny-tail" and stats["remote"]["bytes_sent"] > 0
    assert "buckets" in stats["edge"]


def test_a_remote_serving_another_model_is_one_clear_error(parts, tmp_path) -> None:
    other = _start(tmp_path, MODEL, "--grpc-port", "-1")  # serves 'resnet-tiny', not 'server'
    try:
        remote = kiln.Session(parts.edge_path, remote=other.base, timeout=30)
        with pytest.raises(KilnError, match=f"{other.base} does not serve model 'server'"):
            remote.run(None, _image(0))
    finally:
        _stop(other)


def test_the_server_killed_mid_run_gives_one_clear_error(parts, tmp_path) -> None:
    doomed = _start(tmp_path, str(parts.server_path), "--grpc-port", "-1")
    answered, failed = threading.Event(), []

    def traffic() -> None:
        with kiln.Session(parts.edge_path, remote=doomed.base, timeout=30) as remote:
            try:
                for seed in range(10_000):
                    remote.run(None, _image(seed))
                    answered.set()
            except KilnError as exc:
                failed.append(str(exc))

    client = threading.Thread(target=traffic)
    client.start()
    assert answered.wait(60)  # safety net; the event is the wait
    doomed.proc.kill()
    doomed.proc.wait(30)
    client.join(60)
    assert not client.is_alive(), "the edge session hung after the server died"
    assert len(failed) == 1 and doomed.base in failed[0] and "gone" in failed[0], failed


def test_a_session_without_remote_refuses_remote_settings(parts) -> None:
    with pytest.raises(KilnError, match="timeout= is for a remote session"):
        kiln.Session(parts.edge_path, timeout=3)
    with pytest.raises(KilnError, match="not one"):
        kiln.Session(MODEL, remote="http://127.0.0.1:1")


def test_feedback_on_a_remote_session_is_refused_clearly(parts) -> None:
    # The loop tunes a model run here; the server part is tuned where it is served.
    with pytest.raises(KilnError, match="kiln serve --feedback"):
        kiln.Session(parts.edge_path, remote="http://127.0.0.1:1", feedback=True)


def test_run_options_reach_the_edge_part(parts) -> None:
    import onnxruntime as ort

    stop = ort.RunOptions()
    stop.terminate = True  # refused before the edge part runs, so before the server is asked
    remote = kiln.Session(parts.edge_path, remote="http://127.0.0.1:1")
    with remote, pytest.raises(KilnError, match="terminate is set"):
        remote.run(None, _image(0), stop)
