"""Dynamic-load benchmark: `kiln serve` against ONNX Runtime serving the same stream one by one.

    python benchmarks/serve_dynamic_load.py            # full: bert-base and resnet50 (~10 min)
    python benchmarks/serve_dynamic_load.py --quick    # fewer requests, for development
    python benchmarks/serve_dynamic_load.py --models bert-tiny,resnet-tiny --quick   # mechanics
    python benchmarks/serve_dynamic_load.py --models bert-base --batch 1,32 --seq 128,128 \
        --buckets "" --artifact bert-base=bert-base-int8.kiln   # batch alone jumping, 1..32

Traffic (seeded, identical for both sides): bert-base requests with batch 1..16 and sequence
length 8..256, resnet50 requests with batch 1..32, a fixed number of requests issued by
`--clients` concurrent client threads in a closed loop (each sends its next request when the
previous one is answered). `--batch LO,HI` and `--seq LO,HI` replace a model's ranges (e.g.
batch 1..32 at a fixed 128 tokens: only the batch size jumps).

* **kiln**: `kiln serve` as a subprocess on loopback, with shape buckets, dynamic batching and
  `--warmup`, serving the artifact given by `--artifact MODEL=PATH` (e.g. an int8 artifact from
  `kiln optimize zoo:bert-base --precision int8`), else the zoo model as-is (fp32). Clients are
  the real `tritonclient[http]`, binary tensors, one client per thread.
* **ort**: an onnxruntime.InferenceSession (ORT_ENABLE_ALL, fp32, dynamic shapes) on the zoo
  model, in this process; one worker thread serves the same client threads' requests one by
  one in arrival order, with no HTTP cost at all (which favours it).

The two sides are interleaved (`--rounds`, default 2): the stream is cut into rounds and each
round is served by both, in alternating order, because the machine is shared and drifts.
Reported per side: requests/s, samples/s, P50/P99 latency (from sending a request to having
its outputs), and throughput stability: the coefficient of variation of samples/s over 5-s
windows, beside its floor — the CV a server of perfectly constant speed would show answering
the same whole requests in the same order at the same mean rate (`throughput_cv_floor_5s`):
what the stream's granularity alone gives, which no server answering whole requests goes
below at that rate. Then two runs on kiln with swaps: three forced swaps (POST /v2/models/NAME/swap,
alternating two bucket sets) during the same traffic, and (bert only) one organic swap with
`--adaptive`, triggered by a shift in the traffic mix. Both must have zero failed requests and
no request slower than 3× the steady-state P99. Results go to results/serve_dynamic_load.json
and the result file. Every run stops at `--time-cap` (150 s), so the default run (two
full-size models) takes at most about 20 minutes; `--quick` a quarter of the requests.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import tritonclient.http as triton
from _machine import machine  # benchmarks/ is the script's own directory
from _results import Recorder, add_arguments, row  # benchmarks/ is the script's own directory

from kiln import zoo
from kiln.timing import verdict_of

Feeds = dict[str, np.ndarray]


@dataclass
class Case:
    """One model's traffic and serving settings: requests of `batch` samples (at random within
    the range), text of `seq` tokens or images of `side` pixels; the server batches up to the
    largest request."""

    model: str
    requests: int
    buckets: str  # for the steady run
    alt_buckets: str  # the second set the forced swaps alternate with
    batch: tuple[int, int]
    seq: tuple[int, int] | None = None  # text models
    side: int = 0  # image models

    @property
    def max_batch(self) -> int:
        return self.batch[1]

    def make(self, rng: np.random.Generator) -> Feeds:
        if self.seq is not None:
            return _text(self.batch, self.seq)(rng)
        return _image(self.batch, self.side)(rng)


def _text(batch: tuple[int, int], seq: tuple[int, int]) -> Callable[[np.random.Generator], Feeds]:
    def make(rng: np.random.Generator) -> Feeds:
        b, s = int(rng.integers(batch[0], batch[1] + 1)), int(rng.integers(seq[0], seq[1] + 1))
        return {
            "input_ids": rng.integers(0, 1000, (b, s)).astype(np.int64),
            "attention_mask": np.ones((b, s), np.int64),
            "token_type_ids": np.zeros((b, s), np.int64),
        }

    return make


def _image(batch: tuple[int, int], size: int) -> Callable[[np.random.Generator], Feeds]:
    def make(rng: np.random.Generator) -> Feeds:
        b = int(rng.integers(batch[0], batch[1] + 1))
        return {"input": rng.random((b, 3, size, size), dtype=np.float32)}

    return make


CASES = {
    "bert-base": Case("bert-base", 40, "seq=32,64,128,256", "seq=48,96,160,256", (1, 16), (8, 256)),
    "resnet50": Case(
        "resnet50",
        48,
        "batch=1,2,4,8,12,16,24,32",
        "batch=2,4,8,12,16,24,32",
        (1, 32),
        side=224,
    ),
    # The tiny twins exercise the same machinery in seconds.
    "bert-tiny": Case("bert-tiny", 200, "seq=16,32,64", "seq=24,48,64", (1, 16), (8, 64)),
    "resnet-tiny": Case(
        "resnet-tiny", 200, "batch=1,4,8,16,32", "batch=2,4,8,16,32", (1, 32), side=32
    ),
}


# ---------------------------------------------------------------- driving traffic


@dataclass
class Record:
    start: float
    end: float
    samples: int
    error: str | None
    work: int = 0  # what the request costs, in samples × tokens (samples for images)


def drive(
    call: Callable[[Feeds], object],
    makers: list[Callable[[np.random.Generator], Feeds]],
    clients: int,
    seed: int,
    on_done: Callable[[int], None] | None = None,
    time_cap: float = 1e9,
) -> list[Record]:
    """Issue request i (made by makers[i] from seed+i) from `clients` threads, closed loop;
    after `time_cap` seconds no new request is issued (a safety bound on a loaded machine)."""
    records: list[Record] = []
    lock, next_index = threading.Lock(), [0]
    stop_at = time.perf_counter() + time_cap

    def client() -> None:
        while True:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            if i >= len(makers) or time.perf_counter() > stop_at:
                return
            feeds = makers[i](np.random.default_rng(seed + i))  # made before its clock starts
            start, error = time.perf_counter(), None
            try:
                call(feeds)
            except Exception as exc:  # a failed request is a result, not a crash
                error = f"{type(exc).__name__}: {exc}"[:300]
            end = time.perf_counter()
            with lock:
                first = next(iter(feeds.values()))
                work = int(first.shape[0] * (first.shape[1] if first.ndim == 2 else 1))
                records.append(Record(start, end, len(first), error, work))
                done = len(records)
            if on_done is not None:
                on_done(done)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records


def _windows(ends: list[float], samples: list[int], t0: float, window_s: float) -> np.ndarray:
    """Samples/s in each full window of a run whose requests ended at `ends` (the last,
    partial window is left out)."""
    counts = np.zeros(int((max(ends) - t0) // window_s))
    for end, n in zip(ends, samples, strict=True):
        index = int((end - t0) // window_s)
        if index < len(counts):
            counts[index] += n / window_s
    return counts


def floor_windows(segment: list[Record], window_s: float = 5.0) -> np.ndarray:
    """The windows a server of perfectly constant speed would show on the same requests,
    answered whole in the order this one answered them, at its mean rate of work (samples ×
    tokens; busy throughout, as closed-loop clients keep it): their CV is what the stream's
    granularity alone gives — a window holds a few whole requests of 1–16 samples each."""
    done = sorted((r for r in segment if r.error is None), key=lambda r: r.end)
    if len(done) < 2 or not all(r.work for r in done):
        return np.zeros(0)
    t0 = min(r.start for r in segment)
    rate = sum(r.work for r in done) / (done[-1].end - t0)
    ends = list(t0 + np.cumsum([r.work for r in done]) / rate)
    return _windows(ends, [r.samples for r in done], t0, window_s)


def _cv(rates: np.ndarray) -> float | None:
    return float(rates.std() / rates.mean()) if len(rates) >= 2 and rates.mean() else None


def summarize(segments: list[list[Record]], window_s: float = 5.0) -> dict:
    """Figures over one or more runs (the rounds of one side): wall time is the sum of the
    runs' own, and stability the CV of samples/s over every run's full 5-s windows."""
    records = [r for segment in segments for r in segment]
    ok = [r for r in records if r.error is None]
    wall, windows, floors = 0.0, [], []
    for segment in filter(None, segments):
        t0 = min(r.start for r in segment)
        wall += max(r.end for r in segment) - t0
        done = [r for r in segment if r.error is None]
        if done:
            windows.extend(_windows([r.end for r in done], [r.samples for r in done], t0, window_s))
        floors.extend(floor_windows(segment, window_s))
    cv, floor = _cv(np.array(windows)), _cv(np.array(floors))
    latencies = np.array([r.end - r.start for r in ok]) * 1e3
    return {
        "requests": len(records),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(ok) / wall, 3),
        "samples_per_s": round(sum(r.samples for r in ok) / wall, 2),
        "p50_ms": round(float(np.percentile(latencies, 50)), 1) if len(ok) else None,
        "p99_ms": round(float(np.percentile(latencies, 99)), 1) if len(ok) else None,
        "max_ms": round(float(latencies.max()), 1) if len(ok) else None,
        "throughput_cv_5s": round(cv, 3) if cv is not None else None,
        "throughput_cv_floor_5s": round(floor, 3) if floor is not None else None,
        "windows_5s": len(windows),
    }


# ---------------------------------------------------------------- the two servers


def ort_caller(model: str) -> tuple[Callable[[Feeds], object], Callable[[], None]]:
    """ONNX Runtime, dynamic shapes, in this process: one worker thread answers the requests
    one by one in arrival order (a FIFO queue; a plain lock would let a client starve)."""
    session = ort.InferenceSession(
        zoo.build(model).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    jobs: queue.Queue = queue.Queue()

    def worker() -> None:
        while (job := jobs.get()) is not None:
            feeds, future = job
            try:
                future.set_result(session.run(None, feeds))
            except Exception as exc:
                future.set_exception(exc)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()

    def call(feeds: Feeds) -> object:
        future: Future = Future()
        jobs.put((feeds, future))
        return future.result()

    def stop() -> None:
        jobs.put(None)
        thread.join()

    return call, stop


class KilnServer:
    def __init__(self, source: str, name: str, buckets: str, max_batch: int, *extra: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url, self.name = f"127.0.0.1:{self.port}", name
        cmd = [sys.executable, "-m", "kiln", "serve", source, "--name", name, "--port",
               str(self.port), "--grpc-port", "-1",  # HTTP only; 8001 may be taken
               "--max-batch", str(max_batch), "--max-delay-ms", "5",
               "--warmup", *(["--buckets", buckets] if buckets else []), *extra]  # fmt: skip
        log = (
            Path(tempfile.gettempdir()) / f"kiln-serve-{self.port}.log"
        )  # not a pipe: no one drains it
        with log.open("w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600  # --warmup compiles every bucket first
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kiln serve exited: {log.read_text()}")
            try:
                if httpx.get(f"http://{self.url}/v2/health/ready", timeout=1).is_success:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError("kiln serve did not become ready in 600 s")

    def caller(self) -> Callable[[Feeds], object]:
        local = threading.local()  # tritonclient's client is not thread-safe: one per thread

        def call(feeds: Feeds) -> object:
            if not hasattr(local, "client"):
                local.client = triton.InferenceServerClient(
                    self.url, connection_timeout=600, network_timeout=600
                )
            inputs = []
            for name, array in feeds.items():
                tensor = triton.InferInput(name, list(array.shape), triton_dtype(array))
                tensor.set_data_from_numpy(array, binary_data=True)
                inputs.append(tensor)
            result = local.client.infer(self.name, inputs)  # every output, binary
            return result.get_response()

        return call

    def swap(self, buckets: str | None = None) -> dict:
        body = {"buckets": buckets} if buckets else {}
        url = f"http://{self.url}/v2/models/{self.name}/swap"
        return httpx.post(url, json=body, timeout=600).json()

    def runtime(self) -> dict:
        """The session's stats: buckets, hits, misses, swaps and the decisions taken."""
        return httpx.get(f"http://{self.url}/v2/models/{self.name}/runtime").json()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def triton_dtype(array: np.ndarray) -> str:
    return {"int64": "INT64", "float32": "FP32", "int32": "INT32"}[array.dtype.name]


# ---------------------------------------------------------------- the runs


def _range(text: str) -> tuple[int, int]:
    """A pair of sizes from LO,HI (or N, meaning N,N)."""
    try:
        lo, hi = (int(x) for x in (text.split(",") if "," in text else [text, text]))
    except ValueError:
        lo, hi = 0, 0
    if not 1 <= lo <= hi:
        raise SystemExit(f"a range is LO,HI (or N) with 1 <= LO <= HI, got {text!r}")
    return lo, hi


def traffic(case: Case, batch: str | None, seq: str | None) -> Case:
    """The case with its batch range, and a text model's sequence range, replaced where given."""
    if seq is not None and case.seq is None:
        raise SystemExit(f"--seq: {case.model} takes images, not text")
    return dataclasses.replace(
        case,
        batch=_range(batch) if batch else case.batch,
        seq=_range(seq) if seq else case.seq,
    )


def run_case(case: Case, source: str, args: argparse.Namespace) -> dict:
    n = args.requests or (case.requests // 4 if args.quick else case.requests)
    if args.buckets is not None:  # an override, e.g. "" for none: every request unpadded
        case = dataclasses.replace(case, buckets=args.buckets)
    case = traffic(case, args.batch, args.seq)
    makers = [case.make] * n
    warm = [case.make] * 2
    out: dict = {"model": case.model, "kiln_serves": source, "requests": n,
                 "batch": args.batch, "seq": args.seq, "buckets": case.buckets}  # fmt: skip

    print(f"[{case.model}] kiln serve {source} --buckets '{case.buckets}'", flush=True)
    server = KilnServer(source, case.model, case.buckets, case.max_batch)
    ort_call, ort_stop = ort_caller(case.model)
    try:
        call = server.caller()
        drive(call, warm, 1, seed=10_000)
        drive(ort_call, warm, 1, seed=10_000)
        # Interleaved: the stream is cut into rounds; each round is served by both sides, in
        # alternating order, so the machine's drift (it is shared) hits both alike.
        segments: dict[str, list[list[Record]]] = {"ort": [], "kiln": []}
        bounds = np.linspace(0, n, args.rounds + 1).astype(int)
        for r, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            sides = [("ort", ort_call), ("kiln", call)][:: 1 if r % 2 == 0 else -1]
            for side, caller in sides:
                print(f"[{case.model}] round {r + 1}/{args.rounds}: {side}", flush=True)
                cap = args.time_cap / args.rounds
                segments[side].append(drive(caller, makers[lo:hi], args.clients, lo, None, cap))
        ort_stop()
        out["ort"], out["kiln"] = summarize(segments["ort"]), summarize(segments["kiln"])
        out["kiln"]["runtime"] = _runtime_summary(server.runtime())
        ratios = [
            summarize([k])["samples_per_s"] / summarize([o])["samples_per_s"]
            for k, o in zip(segments["kiln"], segments["ort"], strict=True)
        ]
        out["kiln_vs_ort"] = {
            "throughput_x": round(out["kiln"]["samples_per_s"] / out["ort"]["samples_per_s"], 2),
            "throughput_x_per_round": [round(x, 2) for x in ratios],
            "p99_x": round(out["kiln"]["p99_ms"] / out["ort"]["p99_ms"], 2),
        }
        print(f"  ort  {out['ort']}\n  kiln {out['kiln']}", flush=True)

        # Three forced swaps alternating two bucket sets, one after another from the moment
        # an eighth of the requests are answered, so all three land inside the traffic.
        swaps: list[dict] = []
        swapper = threading.Thread(target=_swap_three_times, args=(server, case, swaps))

        def on_done(done: int) -> None:
            if done == max(1, n // 8):
                swapper.start()

        print(f"[{case.model}] kiln with 3 forced swaps", flush=True)
        records = drive(call, makers, args.clients, 0, on_done, args.time_cap)
        last_answer = max(r.end for r in records)
        swapper.join()
        for swap in swaps:
            swap["during_traffic"] = swap.pop("ended") < last_answer
        forced = summarize([records])
        forced["runtime"] = _runtime_summary(server.runtime())
        out["forced_swaps"] = _judge(forced, out["kiln"]["p99_ms"], swaps)
        print(f"  {out['forced_swaps']}", flush=True)
    finally:
        server.stop()
    return out


def _swap_three_times(server: KilnServer, case: Case, swaps: list[dict]) -> None:
    for buckets in [case.alt_buckets, case.buckets, case.alt_buckets]:
        start = time.perf_counter()
        answer = server.swap(buckets)
        end = time.perf_counter()
        swaps.append(
            {"buckets": buckets, "swapped": answer.get("swapped"),
             "seconds": round(end - start, 2), "ended": end}
        )  # fmt: skip
        time.sleep(1.0)


def run_organic(case: Case, source: str, args: argparse.Namespace) -> dict:
    """--adaptive, with buckets that suit phase A; phase B shifts to lengths those buckets pad
    badly (waste above the policy's 35 %), so the runtime should build and swap in a better
    set by itself. Batch sizes move the other way, so both phases cost about the same once
    the buckets fit, and phase A's P99 is the steady state to compare against."""
    tiny = case.model.endswith("-tiny")
    seq_a, seq_b, buckets = ((12, 16), (20, 28), "seq=16,64") if tiny else (
        (24, 32), (100, 128), "seq=32,256"
    )  # fmt: skip
    n_a, n_b = (40, 200) if tiny else (24, 100)
    makers = [_text((6, 10), seq_a)] * n_a + [_text((1, 2), seq_b)] * n_b
    print(f"[{case.model}] kiln --adaptive, traffic shift {seq_a} -> {seq_b}", flush=True)
    # --max-batch 1: every request runs alone, so the runtime sees one run per request and
    # reaches its judgement (it waits for 50 runs) soon after the shift.
    server = KilnServer(source, case.model, buckets, 1, "--adaptive")
    try:
        call = server.caller()
        drive(call, makers[:2], 1, seed=10_000)
        records = drive(call, makers, args.clients, 0, time_cap=2 * args.time_cap)
        runtime = server.runtime()
    finally:
        server.stop()
    records.sort(key=lambda r: r.start)
    steady = summarize([records[: n_a - args.clients]])  # phase A, before the shift
    result = _judge(summarize([records]), steady["p99_ms"], [])
    result["serves"] = source
    result["steady_phase_a"] = steady
    result["organic_swaps"] = runtime["swaps"]
    result["buckets_before"], result["buckets_after"] = buckets, runtime["bucket_set"]
    result["runtime"] = _runtime_summary(runtime)
    return result


def _runtime_summary(stats: dict) -> dict:
    """What the runtime did: bucket hits and misses (a miss runs on the dynamic executable),
    padding waste, whether padding each dim was judged safe, swaps and decisions."""
    return {
        "hits": stats["hits"],
        "misses": stats["misses"],
        "padding_waste": round(stats["padding_waste"], 3),
        "padding": {d: v["reason"] for d, v in stats["padding"].items()},
        "swaps": stats["swaps"],
        "bucket_set": stats["bucket_set"],
        "decisions": [d["trigger"] + " -> " + d["action"] for d in stats["decisions"]],
    }


def _judge(run: dict, steady_p99: float, swaps: list[dict]) -> dict:
    return {
        **run,
        "swaps": swaps,
        "steady_p99_ms": steady_p99,
        "worst_vs_steady_p99": round(run["max_ms"] / steady_p99, 2),
        "pass": run["failed"] == 0 and run["max_ms"] <= 3 * steady_p99,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="bert-base,resnet50")
    parser.add_argument("--artifact", action="append", default=[], help="MODEL=PATH.kiln")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--buckets", default=None, help="override the steady run's buckets")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per side")
    parser.add_argument("--batch", default=None, help="LO,HI: the batch sizes to jump between")
    parser.add_argument("--seq", default=None, help="LO,HI or N: the sequence lengths (text)")
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests")
    parser.add_argument(
        "--requests", type=int, default=0, help="requests per side (default: the model's own)"
    )
    parser.add_argument("--no-organic", action="store_true")
    parser.add_argument("--organic-only", action="store_true")
    parser.add_argument(
        "--organic-source",
        default=None,
        help="what the organic run serves (default zoo:MODEL, fp32: it needs a model whose "
        "padding Kiln verifies as safe, which dynamic-int8 artifacts are not)",
    )
    parser.add_argument(
        "--time-cap", type=float, default=150, help="seconds per run before clients stop"
    )
    parser.add_argument("-o", "--output", default="results/serve_dynamic_load.json")
    add_arguments(parser)
    args = parser.parse_args()
    recorder = Recorder("serve_dynamic_load")
    artifacts = dict(a.split("=", 1) for a in args.artifact)
    here = machine()
    print(f"command: {' '.join(sys.argv)}\nmachine: {here}", flush=True)
    result = {
        "command": " ".join(sys.argv),
        "clients": args.clients,
        "cpus": os.cpu_count(),
        "machine": here,
        "versions": {"onnxruntime": ort.__version__},
        "load_average_at_start": os.getloadavg(),
        "cases": [],
    }
    for model in args.models.split(","):
        case = CASES[model]
        source = artifacts.get(model, f"zoo:{model}")
        result["cases"].append(
            {"model": model} if args.organic_only else run_case(case, source, args)
        )
        if model.startswith("bert") and not args.no_organic:
            organic = args.organic_source or f"zoo:{model}"
            result["cases"][-1]["organic_swap"] = run_organic(case, organic, args)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    recorder.write(load_rows(result["cases"]), result, args.results)


def load_rows(cases: list[dict]) -> list[dict]:
    """Per model: kiln serve's samples/s over ONNX Runtime's, then each swap run's verdict."""
    found = []
    for case in cases:
        model = case["model"]
        compared = case.get("kiln_vs_ort")
        if compared:
            rounds = compared["throughput_x_per_round"]
            low, high = min(rounds), max(rounds)
            verdict = verdict_of(low, high) if len(rounds) >= 3 else "unknown"
            found.append(row(f"{model}: samples/s kiln serve ÷ onnxruntime in-process",
                             compared["throughput_x"], "x", [low, high], verdict, model=model,
                             engine="kiln serve", baseline="ort"))  # fmt: skip
        for run in ("forced_swaps", "organic_swap"):
            judged = case.get(run)
            if judged and "pass" in judged:
                verdict = "pass" if judged["pass"] else "fail"
                found.append(row(f"{model}: {run.replace('_', ' ')}, worst ÷ steady P99",
                                 judged.get("worst_vs_steady_p99"), "x", verdict=verdict,
                                 model=model))  # fmt: skip
    return found


if __name__ == "__main__":
    main()
