"""The feedback loop: when live traffic shifts (batch 1 → bursts of batch 16) on buckets
made for other traffic (batch 1 and 32: a 16 is padded to 32) the loop diagnoses the waste,
measures new buckets on the replayed requests and hot-swaps them in with no failed request;
a worse strategy is refused with its measurement; both are in the strategy library, and so
are the traffic windows."""

from __future__ import annotations

import threading
import time

import numpy as np

import kiln
from kiln.tune.feedback import FeedbackLoop, Strategy
from kiln.tune.library import Library
from kiln.tune.storage import default_url


def images(batch: int) -> dict[str, np.ndarray]:
    return {"input": np.random.default_rng(batch).random((batch, 3, 32, 32), np.float32)}


def test_traffic_shift_adopts_new_buckets_and_refuses_a_worse_strategy():
    session = kiln.Session("zoo:resnet-tiny", buckets="batch=1,32", keep_requests=64)
    loop = FeedbackLoop(session, library_url=default_url(), seconds=3.0)
    for _ in range(30):
        session.run(None, images(1))
    loop.cycle()
    assert all(o.strategy.name != "rebucket" for o in loop.outcomes)  # batch 1: no padding

    failures, served, stop = [], [0], threading.Event()

    def bursts() -> None:  # live traffic during diagnosis, measurement and the swap
        while not stop.is_set():
            try:
                out = session.run(None, images(16))[0]
                assert out.shape == (16, 10)
                served[0] += 1
            except Exception as exc:  # noqa: BLE001 - any failure is the test's finding
                failures.append(exc)
            time.sleep(0.1)  # sparse: the A/B measurement shares these 2 cores

    traffic = threading.Thread(target=bursts)
    traffic.start()
    try:
        while served[0] < 25:
            time.sleep(0.05)
        outcomes = loop.cycle()
        adopted = [o for o in outcomes if o.adopted]
        assert [o.strategy.name for o in adopted] == ["rebucket"], [
            (o.strategy.name, o.reason) for o in outcomes
        ]
        assert session.buckets == {"batch": [1, 16, 32]} and adopted[0].gain >= 0.10
        before = served[0]
        while served[0] < before + 10:  # the swapped-in configuration answers
            time.sleep(0.05)
    finally:
        stop.set()
        traffic.join()
    assert failures == []

    worse = loop.try_strategy(Strategy("worse", {"optimization": "disable", "intra_op_threads": 1},
                                       "a deliberately worse configuration"))  # fmt: skip
    assert not worse.adopted and worse.gain < 0 and "below the 10% needed" in worse.reason
    assert session.options["optimization"] == "all"  # unchanged

    library = Library(default_url())
    kinds = {(r.kind, r.evidence["strategy"]) for r in library.records()}
    assert {("adopted", "rebucket"), ("refused", "worse")} <= kinds
    refused = next(r for r in library.records(kind="refused") if r.evidence["strategy"] == "worse")
    assert refused.evidence["measurement"]["ratio"]["value"] > 1  # measured, slower
    windows = library.windows(loop.model)
    assert len(windows) == 2 and windows[1]["mean_batch"] == 16
    session.close()


def test_kiln_serve_feedback_stores_windows_of_live_traffic(tmp_path):
    import httpx
    from test_serve import _resnet_request, _start, _stop, _until

    server = _start(tmp_path, "zoo:resnet-tiny", "--feedback", "--feedback-interval", "1")
    try:
        url = f"{server.base}/v2/models/resnet-tiny/infer"
        codes = [httpx.post(url, content=_resnet_request(1)).status_code for _ in range(60)]
        assert set(codes) == {200}
        library = Library(f"sqlite:///{tmp_path / 'tune.db'}")
        _until(lambda: library.windows("resnet-tiny"), "a stored traffic window", timeout=60)
        window = library.windows("resnet-tiny")[0]
        assert window["requests"] >= 20 and window["batches"] == {"1": window["requests"]}
        assert window["queue_depth"] is not None and window["cpu_percent"] >= 0
    finally:
        _stop(server)


def test_the_loop_keeps_seeing_traffic_once_the_monitors_window_is_full():
    from kiln.runtime.monitor import LoadMonitor, Observation

    monitor = LoadMonitor(window=10)
    for _ in range(30):  # the bounded window has stayed at its length for 20 of these
        monitor.record(Observation({"batch": 1}, "dynamic", 1e-3, 1, 1), 1)
    seen, cursor = monitor.since(0)
    assert len(seen) == 10 and cursor == 30
    assert monitor.since(cursor)[0] == []
    monitor.record(Observation({"batch": 16}, "dynamic", 2e-3, 16, 16), 1)
    fresh, cursor = monitor.since(cursor)
    assert [o.dims for o in fresh] == [{"batch": 16}] and cursor == 31


def test_kiln_session_with_feedback_attaches_a_loop_that_close_stops():
    before = set(threading.enumerate())
    session = kiln.Session("zoo:resnet-tiny", feedback=True, feedback_options={"interval_s": 600})
    loop = session.feedback
    assert isinstance(loop, FeedbackLoop) and loop.session is session
    assert session.keep_requests == 256  # replayed by the loop's A/B rounds
    started = [t for t in threading.enumerate() if t not in before and t.name == "kiln-feedback"]
    assert len(started) == 1
    session.close()
    assert not started[0].is_alive()
