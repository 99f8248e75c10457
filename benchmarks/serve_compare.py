"""`kiln serve` over HTTP and gRPC against Triton serving the same artifacts
through Kiln's runtime, and what `kiln serve` adds to a lone request.

    python benchmarks/serve_compare.py --work /tmp/sc     # resnet50, bert-base, all defaults
    python benchmarks/serve_compare.py --artifacts /tmp/sc/resnet50.kiln,/tmp/sc/bert-base.kiln
    python benchmarks/serve_compare.py --models resnet-tiny,bert-tiny --seconds 1 --rounds 2

The default run is 72 blocks (2 models × 3 client counts × 4 servers × 3 rounds) of at least
3 s each (3.6 minutes), then the lone-request rounds, after the two builds of full-size models
(skipped with `--artifacts`); `--models resnet-tiny,bert-tiny --seconds 1 --rounds 2` takes
about a minute and a half.

Setup: the artifacts are built with kiln.compile (zoo:NAME, Kiln's defaults) unless
`--artifacts` gives them. One `kiln serve` (`--port 0 --json`: HTTP and gRPC on free ports)
serves every artifact, and beside each a *null twin*: a model with the artifact's inputs and
outputs of the same shapes and types that computes nothing (zeros expanded to the request's
batch), so its round trip is the serving cost alone — the same bytes each way, the same
batcher. Triton (tritonserver and its Python backend from the nvidia-pytriton wheel, see
kiln.deploy.local_triton) serves `kiln export --triton --runtime kiln` of each artifact; when it
cannot start, or with `--no-triton`, its rows are left out with the reason.

Throughput: for each model × clients (`--clients`, 1/4/16) × server (kiln-http, kiln-grpc,
triton-http, triton-grpc), a block of closed-loop clients: one tritonclient client object
per thread, each sending the model's batch-1 reference input (kiln.ir.inputs.synthesize at
the model's dims) and the next request when the answer is in. A block runs `--warmup` s, not
counted, then at least `--seconds` s and until every client has had 2 answers; its latencies
are the requests answered after the warm-up, and its throughput is clients / mean latency
(Little's law for a closed loop: counting answers in a window is quantized by batching, where
16 clients are answered together). Blocks are interleaved: `--rounds` rounds, each running
every cell once, servers in rotated order. Per cell: req/s, P50 and P99, each the median over
rounds with the lowest–highest round; and kiln/triton throughput per protocol, the median of
per-round ratios.

Lone requests (one client, after the throughput blocks), interleaved in blocks of
`--lone-runs` over `--lone-rounds` rounds (kiln.timing.interleave): in-process
`kiln.Session(artifact).run(None, feeds)`, `kiln serve` HTTP and gRPC on the artifact, the
null twin in-process and over HTTP and gRPC, and `GET v2/health/ready` (the bare loopback
round trip), and Triton over HTTP and gRPC on the same model where it runs (kiln serve's lone
P50 over Triton's, and the median and range of the per-round ratios). The protocol's cost is
null-over-protocol P50 − null-in-process P50; the check is `serve P50 / (Session.run P50 +
that cost)` within 5 % (0.95–1.05), with the range of the per-round ratios. Prints the
command, CPU, versions and every figure; writes the result file (benchmarks/_results.py) to
benchmarks/results/serve_compare/<date>-<cpu class>-<commit>.json, and the raw figures to
`--json` when given.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, closing, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from _machine import machine  # benchmarks/ is the script's own directory
from _results import Recorder, add_arguments
from _serve_report import print_cells, print_lone, rows_of
from onnx import helper, numpy_helper
from tritonclient.utils import np_to_triton_dtype

import kiln
from kiln.deploy import export_triton, local_triton
from kiln.hardware import cpu_info
from kiln.ir.inputs import synthesize
from kiln.timing import interleave, round_p50_ms, round_ratios

Feeds = dict[str, np.ndarray]
MIN_ANSWERS = 2  # per client and block, after the warm-up
TIMEOUT_S = 300  # a single request; a hung server fails the block instead of hanging it
WITHIN = 0.05
# Triton's Python environment, where tests/test_triton_server.py keeps it (pytest's cache, as
# it names it) under the same key: whichever runs first builds it for both.
TRITON_CACHE = Path(__file__).resolve().parent.parent / ".pytest_cache" / "d" / "kiln-triton"


# ---------------------------------------------------------------- clients


@dataclass(frozen=True)
class Target:
    """One server endpoint as tritonclient reaches it."""

    name: str  # kiln-http, kiln-grpc, triton-http, triton-grpc
    url: str  # host:port
    protocol: str  # http | grpc

    @property
    def module(self):
        return triton_http if self.protocol == "http" else triton_grpc

    def client(self):
        if self.protocol == "http":
            return triton_http.InferenceServerClient(
                self.url, connection_timeout=TIMEOUT_S, network_timeout=TIMEOUT_S
            )
        return triton_grpc.InferenceServerClient(self.url)

    def infer(self, client, model: str, feeds: Feeds):
        """One request as a client makes it: tensors built from numpy, binary, every output."""
        tensors = []
        for name, array in feeds.items():
            datatype = np_to_triton_dtype(array.dtype)
            tensor = self.module.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        if self.protocol == "grpc":
            return client.infer(model, tensors, client_timeout=TIMEOUT_S)
        return client.infer(model, tensors)


def check_answers(target: Target, model: str, feeds: Feeds, want: dict[str, np.ndarray]) -> None:
    """A few warm-up requests; the last answer must be kiln.Session's (what is timed must be
    a right answer, not an error or a wrong shape)."""
    with closing(target.client()) as client:
        for _ in range(3):
            result = target.infer(client, model, feeds)
    for name, expected in want.items():
        got = result.as_numpy(name)
        if (
            got is None
            or got.shape != expected.shape
            or not np.allclose(got, expected, rtol=1e-4, atol=1e-5)
        ):
            shape = None if got is None else got.shape
            raise SystemExit(f"{target.name} answers {model}'s output {name} with shape {shape}, "
                             f"not kiln.Session's {expected.shape} (or other values)")  # fmt: skip


# ---------------------------------------------------------------- artifacts and null twins


def build_artifacts(models: list[str], work: Path) -> dict[str, Path]:
    built = {}
    for name in models:
        start = time.perf_counter()
        built[name] = kiln.compile(f"zoo:{name}", work / f"{name}.kiln").path
        print(f"built zoo:{name} → {built[name]} in {time.perf_counter() - start:.0f} s",
              flush=True)  # fmt: skip
    return built


def null_twin(artifact: Path, outputs: dict[str, np.ndarray], path: Path) -> Path:
    """A model with `artifact`'s inputs, and outputs of the names, shapes and types of
    `outputs` (a dim named as the first input's first dim follows the request's batch) that
    computes nothing: every input is read for its batch size only (Shape, Max) and each output
    is zeros expanded to that size."""
    real = onnx.load(artifact / "model.onnx", load_external_data=False)
    weights = {t.name for t in real.graph.initializer}
    inputs = [v for v in real.graph.input if v.name not in weights]
    first = inputs[0].type.tensor_type.shape.dim
    batch = first[0].dim_param if first else ""
    nodes = [helper.make_node("Shape", [v.name], [f"n{i}"], end=1) for i, v in enumerate(inputs)]
    nodes.append(helper.make_node("Max", [f"n{i}" for i in range(len(inputs))], ["n"]))
    weights_out, infos = [], []
    for value in real.graph.output:
        array = outputs[value.name]
        dims = value.type.tensor_type.shape.dim
        batched = bool(batch) and len(dims) > 0 and dims[0].dim_param == batch
        zeros = numpy_helper.from_array(np.zeros_like(array), f"{value.name}_zeros")
        rest = numpy_helper.from_array(np.array(array.shape[1:], np.int64), f"{value.name}_rest")
        weights_out += [zeros, rest]
        if batched:
            nodes += [
                helper.make_node("Concat", ["n", rest.name], [f"{value.name}_shape"], axis=0),
                helper.make_node("Expand", [zeros.name, f"{value.name}_shape"], [value.name]),
            ]
        else:
            nodes.append(helper.make_node("Identity", [zeros.name], [value.name]))
        shape = [batch, *array.shape[1:]] if batched else list(array.shape)
        infos.append(helper.make_tensor_value_info(value.name, zeros.data_type, shape))
    graph = helper.make_graph(nodes, path.stem, inputs, infos, weights_out)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


@dataclass
class Model:
    name: str
    artifact: Path
    null: Path
    feeds: Feeds
    outputs: dict[str, np.ndarray]  # kiln.Session's answer to feeds
    session: kiln.Session
    null_session: kiln.Session

    @property
    def null_name(self) -> str:
        return self.null.stem


def prepare(name: str, artifact: Path, work: Path) -> Model:
    session = kiln.Session(str(artifact))
    feeds = synthesize(session.interface)
    outputs = dict(zip(session.output_names, session.run(None, feeds), strict=True))
    null = null_twin(artifact, outputs, work / f"{name}-null.onnx")
    return Model(name, artifact, null, feeds, outputs, session, kiln.Session(str(null)))


# ---------------------------------------------------------------- servers


@contextmanager
def kiln_serve(sources: list[Path], log: Path) -> Iterator[subprocess.Popen]:
    command = [sys.executable, "-m", "kiln", "serve", *map(str, sources), "--port", "0", "--json"]
    with log.open("w") as err:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        yield proc
    finally:
        local_triton.stop(proc)


def kiln_targets(proc: subprocess.Popen, log: Path) -> list[Target]:
    """Waits for `kiln serve --json`'s line: it comes once both protocols serve."""
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"kiln serve exited with {proc.wait()}: {local_triton.tail(log)}")
    ready = json.loads(line)
    host = ready["host"]
    return [Target("kiln-http", f"{host}:{ready['port']}", "http"),
            Target("kiln-grpc", f"{host}:{ready['grpc_port']}", "grpc")]  # fmt: skip


def start_triton(stack: ExitStack, models: list[Model], work: Path) -> tuple[list[Target], dict]:
    """Triton on `kiln export --triton --runtime kiln` of each artifact; no targets and the
    reason when it cannot start."""
    repository = work / "triton-repo"
    for model in models:
        export_triton(model.artifact, repository, name=model.name, runtime="kiln", force=True)
    try:
        env = local_triton.ensure_env(local_triton.env_dir(TRITON_CACHE))
        server = stack.enter_context(
            local_triton.running(repository, [m.name for m in models], work / "triton", env=env)
        )
    except local_triton.TritonUnavailable as exc:
        return [], {"skipped": str(exc)}
    about = {"version": server.version()}
    return [Target("triton-http", server.http, "http"),
            Target("triton-grpc", server.grpc, "grpc")], about  # fmt: skip


def batcher(target: Target, model: str) -> dict:
    """What the server says of its batcher for `model` (its ModelConfig)."""
    with closing(triton_http.InferenceServerClient(target.url)) as client:
        config = client.get_model_config(model)
    delay = (config.get("dynamic_batching") or {}).get("max_queue_delay_microseconds", 0)
    return {"max_batch_size": int(config.get("max_batch_size", 0)), "max_delay_us": int(delay)}


# ---------------------------------------------------------------- closed-loop blocks


def block(target: Target, model: Model, clients: int, seconds: float, warmup: float) -> dict:
    """`clients` closed-loop clients for `warmup` s (not counted), then `seconds` s and until
    each has had MIN_ANSWERS answers; figures of the requests answered after the warm-up."""
    clock: dict[str, float] = {}

    def start_clock() -> None:  # run once, when every client object exists
        now = time.perf_counter()
        clock.update(begin=now + warmup, end=now + warmup + seconds)

    ready = threading.Barrier(clients, action=start_clock, timeout=TIMEOUT_S)
    latencies: list[list[float]] = [[] for _ in range(clients)]
    errors: list[str] = []

    def client(mine: list[float]) -> None:
        with closing(target.client()) as connection:
            ready.wait()
            while True:
                start = time.perf_counter()
                try:
                    target.infer(connection, model.name, model.feeds)
                except Exception as exc:  # a failed request ends this client, and is reported
                    errors.append(f"{type(exc).__name__}: {exc}"[:300])
                    return
                end = time.perf_counter()
                if end >= clock["begin"]:
                    mine.append(end - start)
                if end >= clock["end"] and len(mine) >= MIN_ANSWERS:
                    return

    threads = [threading.Thread(target=client, args=(mine,)) for mine in latencies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    times = np.array([t for mine in latencies for t in mine]) * 1e3
    if not len(times):
        return {"answered": 0, "errors": len(errors), "error": errors[0] if errors else None}
    return {
        "answered": len(times),
        "rps": clients * 1e3 / float(times.mean()),  # Little's law, closed loop
        "p50_ms": float(np.percentile(times, 50)),
        "p99_ms": float(np.percentile(times, 99)),
        "seconds": time.perf_counter() - clock["begin"],
        "errors": len(errors),
        "error": errors[0] if errors else None,
    }


def throughput(targets: list[Target], models: list[Model], args) -> dict[tuple, list[dict]]:
    """Every cell once per round, servers rotated each round."""
    blocks: dict[tuple, list[dict]] = {}
    for r in range(args.rounds):
        order = targets[r % len(targets) :] + targets[: r % len(targets)]
        for model in models:
            for clients in args.clients:
                for target in order:
                    figures = block(target, model, clients, args.seconds, args.warmup)
                    blocks.setdefault((model.name, clients, target.name), []).append(figures)
                    print(f"round {r + 1}/{args.rounds}  {model.name:12} {clients:>3} clients  "
                          f"{target.name:12} {_block_text(figures)}", flush=True)  # fmt: skip
    return blocks


def _block_text(figures: dict) -> str:
    if not figures["answered"]:
        return f"no answers: {figures['error']}"
    text = (f"{figures['rps']:8.1f} req/s  P50 {figures['p50_ms']:8.2f} ms  "
            f"P99 {figures['p99_ms']:8.2f} ms  ({figures['answered']} answers)")  # fmt: skip
    return text + (f"  {figures['errors']} ERRORS: {figures['error']}" if figures["errors"] else "")


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def cells(blocks: dict[tuple, list[dict]]) -> list[dict]:
    out = []
    for (model, clients, server), rounds in blocks.items():
        answered = [b for b in rounds if b["answered"]]
        cell = {"model": model, "clients": clients, "server": server, "rounds": rounds,
                "errors": sum(b["errors"] for b in rounds)}  # fmt: skip
        for key in ("rps", "p50_ms", "p99_ms"):
            cell[key] = spread([b[key] for b in answered]) if answered else None
        out.append(cell)
    return out


def kiln_over_triton(blocks: dict[tuple, list[dict]]) -> list[dict]:
    """Per model × clients × protocol: kiln's throughput over Triton's, the median of
    per-round ratios (each round's blocks ran side by side) and their range."""
    out = []
    for (model, clients, server), rounds in blocks.items():
        other = blocks.get((model, clients, server.replace("kiln", "triton")))
        if not server.startswith("kiln") or other is None:
            continue
        ratios = [k["rps"] / t["rps"] for k, t in zip(rounds, other, strict=True)
                  if k["answered"] and t["answered"]]  # fmt: skip
        if ratios:
            out.append({"model": model, "clients": clients, "protocol": server.split("-")[1],
                        "throughput_ratio": spread(ratios)})  # fmt: skip
    return out


# ---------------------------------------------------------------- lone requests


def lone(model: Model, targets: list[Target], rounds: int, runs: int) -> dict:
    """One client, nothing else running: Session.run in-process against kiln serve, the
    protocol's cost measured on the null twin, and Triton on the same model where it runs."""
    kiln_http, kiln_grpc = targets[0], targets[1]
    with ExitStack() as clients:
        http, grpc = (clients.enter_context(closing(t.client())) for t in targets[:2])
        triton = {t.name.replace("-", "_"): (t, clients.enter_context(closing(t.client())))
                  for t in targets[2:]}  # fmt: skip
        runners = {
            "session": lambda: model.session.run(None, model.feeds),
            "serve_http": lambda: kiln_http.infer(http, model.name, model.feeds),
            "serve_grpc": lambda: kiln_grpc.infer(grpc, model.name, model.feeds),
            "null_session": lambda: model.null_session.run(None, model.feeds),
            "null_http": lambda: kiln_http.infer(http, model.null_name, model.feeds),
            "null_grpc": lambda: kiln_grpc.infer(grpc, model.null_name, model.feeds),
            "health_http": http.is_server_ready,
        }
        for name, (target, client) in triton.items():
            runners[name] = _infer_runner(target, client, model)
        samples = interleave(runners, rounds=rounds, runs=runs, warmup=5)
    p50 = {name: round_p50_ms(rounds_) for name, rounds_ in samples.items()}
    out: dict = {"p50_ms": p50, "runs": runs, "rounds": rounds}
    for protocol in ("http", "grpc"):
        cost = p50[f"null_{protocol}"] - p50["null_session"]
        ratio = p50[f"serve_{protocol}"] / (p50["session"] + cost)
        per_round = [_median(s) / (_median(b) + _median(n) - _median(ns)) for s, b, n, ns in zip(
            samples[f"serve_{protocol}"], samples["session"], samples[f"null_{protocol}"],
            samples["null_session"], strict=True)]  # fmt: skip
        out[protocol] = {
            "cost_ms": cost,
            "serve_minus_session_ms": p50[f"serve_{protocol}"] - p50["session"],
            "ratio": ratio,
            "ratio_rounds": [min(per_round), max(per_round)],
            "within_5pct": abs(ratio - 1) <= WITHIN,
        }
        if f"triton_{protocol}" in samples:
            out[protocol]["over_triton"] = _over(
                samples[f"serve_{protocol}"], samples[f"triton_{protocol}"]
            )
    return out


def _infer_runner(target: Target, client, model: Model):
    return lambda: target.infer(client, model.name, model.feeds)


def _over(kiln_rounds: list[list[float]], triton_rounds: list[list[float]]) -> dict:
    """kiln serve's lone P50 over Triton's: the ratio of the round-median P50s, and the
    median and range of the per-round ratios (each round ran both side by side)."""
    per_round = round_ratios(kiln_rounds, triton_rounds)  # P50(kiln) / P50(Triton) per round
    return {
        "ratio": round_p50_ms(kiln_rounds) / round_p50_ms(triton_rounds),
        "rounds": spread(per_round),
    }


def _median(seconds: list[float]) -> float:
    return statistics.median(seconds)


# ---------------------------------------------------------------- main


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="resnet50,bert-base", help="zoo models to build")
    parser.add_argument(
        "--artifacts", default=None, help="NAME.kiln artifacts to serve instead (comma-separated)"
    )
    parser.add_argument("--clients", default="1,4,16")
    parser.add_argument("--seconds", type=float, default=2.5, help="counted seconds per block")
    parser.add_argument("--warmup", type=float, default=0.5, help="uncounted seconds per block")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lone-rounds", type=int, default=5)
    parser.add_argument("--lone-runs", type=int, default=20)
    parser.add_argument("--no-triton", action="store_true")
    parser.add_argument("--lone-only", action="store_true", help="only the lone-request rounds")
    parser.add_argument(
        "--work",
        default=None,
        help="keep the artifacts built, null twins, "
        "Triton repository and logs here (default: a temporary directory)",
    )
    parser.add_argument("--json", default=None, help="also write the raw figures here")
    add_arguments(parser)
    args = parser.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    return args


def workdir(given: str | None):
    if given is None:
        return tempfile.TemporaryDirectory(prefix="kiln-serve-compare-")
    Path(given).mkdir(parents=True, exist_ok=True)
    return nullcontext(given)


def _version(package: str) -> str | None:
    """A package's version, None where it is not installed (kiln serve's HTTP parser and
    event loop follow what is: httptools and uvloop where installed, else h11 and asyncio)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def header() -> dict:
    cpu = cpu_info()
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(),
        "versions": {"kiln": kiln.__version__, "onnxruntime": onnxruntime.__version__,
                     "tritonclient": metadata.version("tritonclient"),
                     "grpcio": metadata.version("grpcio"), "python": platform.python_version(),
                     **{name: _version(name) for name in ("uvicorn", "httptools", "uvloop")}},
    }  # fmt: skip
    print(result["command"])
    print(f"{cpu.model}, {cpu.logical_cores} cores, {platform.platform()}")
    print(", ".join(f"{k} {v}" for k, v in result["versions"].items()), flush=True)
    return result


def main() -> None:
    args = parse()
    recorder = Recorder("serve_compare")
    result = header()
    with workdir(args.work) as where, ExitStack() as stack:
        work = Path(where)
        if args.artifacts:
            paths = [Path(p) for p in args.artifacts.split(",")]
            artifacts = {p.stem: p for p in paths}
        else:
            artifacts = build_artifacts(args.models.split(","), work)
        models = [prepare(name, path, work) for name, path in artifacts.items()]
        sources = [p for m in models for p in (m.artifact, m.null)]
        log = work / "kiln-serve.log"
        proc = stack.enter_context(kiln_serve(sources, log))  # starts while Triton does
        triton: list[Target] = []
        about = {"skipped": "--no-triton"}
        if not args.no_triton:
            triton, about = start_triton(stack, models, work)
        targets = kiln_targets(proc, log) + triton
        if "skipped" in about:
            print(f"Triton left out: {about['skipped']}", flush=True)
        else:
            result["versions"]["tritonserver"] = about["version"]
            print(f"tritonserver {about['version']}", flush=True)
        for model in models:
            for target in targets:
                check_answers(target, model.name, model.feeds, model.outputs)
            for target in targets[:2]:  # the null twin answers zeros of the same shapes
                zeros = {k: np.zeros_like(v) for k, v in model.outputs.items()}
                check_answers(target, model.null_name, model.feeds, zeros)
        count = args.rounds * len(models) * len(args.clients) * len(targets)
        print(
            f"{count} blocks of ≥ {args.warmup + args.seconds:g} s "
            f"(≥ {count * (args.warmup + args.seconds) / 60:.1f} min)",
            flush=True,
        )
        blocks = {} if args.lone_only else throughput(targets, models, args)
        result.update({
            "settings": settings(args, models),
            "artifacts": {m.name: str(m.artifact) for m in models},
            "inputs": {m.name: {k: list(v.shape) for k, v in m.feeds.items()} for m in models},
            "batchers": {t.name: {m.name: batcher(t, m.name) for m in models}
                         for t in targets if t.protocol == "http"},
            "triton": about,
            "cells": cells(blocks),
            "kiln_over_triton": kiln_over_triton(blocks),
            "lone": {},
        })  # fmt: skip
        print_cells(result["cells"], result["kiln_over_triton"])
        for model in models:
            figures = lone(model, targets, args.lone_rounds, args.lone_runs)
            result["lone"][model.name] = figures
            print_lone(model.name, figures)
        for model in models:
            model.session.close()
            model.null_session.close()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    print(f"wrote {recorder.write(rows_of(result), result, args.results)}")


def settings(args: argparse.Namespace, models: list[Model]) -> dict:
    """The options as run, `models` naming what was really served (--artifacts or built)."""
    kept = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
            if k not in ("json", "results")}  # fmt: skip
    return kept | {"models": ",".join(m.name for m in models)}


if __name__ == "__main__":
    main()
