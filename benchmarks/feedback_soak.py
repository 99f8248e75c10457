"""`kiln serve --feedback` under shifting traffic for a long time.

    python benchmarks/feedback_soak.py [--minutes 30] [--model zoo:resnet-tiny]
        [--buckets batch=1,32] [--interval 30] [-o feedback_soak.json]

The server starts with buckets made for other traffic; clients then cycle through phases
(steady batch 1; bursts of batch 16; mixed batches 1-32) a few minutes each. Every answer is
checked (status 200, output shape). Reported: requests, failed requests (the target is 0),
latency per phase, and the strategies the loop adopted and refused, with their evidence.
The run takes `--minutes` (30 by default) and a few seconds to start and stop the server.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from _results import Recorder, add_arguments, row  # benchmarks/ is the script's own directory

from kiln.tune.library import Library

PHASES = [("steady batch 1", [1]), ("bursts of batch 16", [16]), ("mixed 1-32", [1, 4, 8, 32])]


def request(batch: int, rng: np.random.Generator) -> bytes:
    data = rng.random((batch, 3, 32, 32), dtype=np.float32)
    return json.dumps({"inputs": [{"name": "input", "datatype": "FP32",
                                   "shape": list(data.shape),
                                   "data": data.ravel().tolist()}]}).encode()  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--model", default="zoo:resnet-tiny")
    parser.add_argument("--buckets", default="batch=1,32")
    parser.add_argument("--interval", type=float, default=30)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("-o", "--output", default="feedback_soak.json")
    add_arguments(parser)
    args = parser.parse_args()
    recorder = Recorder("feedback_soak")
    home = Path(tempfile.mkdtemp(prefix="soak-"))
    command = [sys.executable, "-m", "kiln", "serve", args.model, "--port", "0", "--json",
               "--buckets", args.buckets, "--feedback", "--feedback-interval",
               str(args.interval)]  # fmt: skip
    log = (home / "serve.log").open("w")
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True,
                              env={**os.environ, "KILN_HOME": str(home)})  # fmt: skip
    ready = json.loads(server.stdout.readline())
    url = f"http://127.0.0.1:{ready['port']}/v2/models/{ready['model']}/infer"
    phase_s = args.minutes * 60 / (2 * len(PHASES))  # every phase twice
    stats: dict[str, dict] = {name: {"ms": [], "failed": 0} for name, _ in PHASES}
    current = [PHASES[0]]
    stop = threading.Event()

    def client(seed: int) -> None:
        rng = np.random.default_rng(seed)
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                name, sizes = current[0]
                batch = int(rng.choice(sizes))
                start = time.perf_counter()
                try:
                    answer = http.post(url, content=request(batch, rng))
                    ok = answer.status_code == 200 and answer.json()["outputs"][0]["shape"] == [
                        batch, 10]  # fmt: skip
                except httpx.HTTPError:
                    ok = False
                stats[name]["ms" if ok else "failed"] = (
                    stats[name]["ms"] + [(time.perf_counter() - start) * 1e3] if ok
                    else stats[name]["failed"] + 1
                )  # fmt: skip
                time.sleep(0.01 if batch == 1 else 0.05)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    for t in threads:
        t.start()
    started = time.time()
    for phase in PHASES * 2:
        current[0] = phase
        print(f"{time.time() - started:6.0f} s: {phase[0]}", file=sys.stderr)
        time.sleep(phase_s)
    stop.set()
    for t in threads:
        t.join()
    server.send_signal(signal.SIGINT)
    server.wait(60)
    library = Library(f"sqlite:///{home / 'tune.db'}")
    outcomes = [
        {"kind": r.kind, "strategy": r.evidence["strategy"], "reason": r.evidence["reason"]}
        for r in library.records() if r.kind in ("adopted", "refused")
    ]  # fmt: skip
    result = {
        "command": " ".join(["python", *sys.argv]), "minutes": args.minutes,
        "requests": sum(len(s["ms"]) + s["failed"] for s in stats.values()),
        "failed": sum(s["failed"] for s in stats.values()),
        "phases": {n: {"answered": len(s["ms"]), "failed": s["failed"],
                       "p50_ms": float(np.percentile(s["ms"], 50)) if s["ms"] else None,
                       "p99_ms": float(np.percentile(s["ms"], 99)) if s["ms"] else None}
                   for n, s in stats.items()},
        "adopted": [o for o in outcomes if o["kind"] == "adopted"],
        "refused": [o for o in outcomes if o["kind"] == "refused"],
        "windows": len(library.windows(ready["model"])),
    }  # fmt: skip
    Path(args.output).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "refused"}, indent=2))
    rows = [
        row(
            "failed requests",
            result["failed"],
            "requests",
            verdict="pass" if result["failed"] == 0 else "fail",
            model=args.model,
        )
    ]
    rows += [
        row(f"{name}: P50", phase["p50_ms"], "ms", model=args.model)
        for name, phase in result["phases"].items()
    ]
    recorder.write(rows, result, args.results)  # fmt: skip


if __name__ == "__main__":
    main()
