"""A bucketed kiln.Session against the same engine's plain dynamic-shape
session, on requests of random shape (BERT-base: batch 1..16, seq 8..256), one by one.

    python benchmarks/buckets_vs_dynamic.py [--backend ort|openvino] [--budget 60]
        [--buckets "batch=1,2,4,8,16 seq=32,64,128,256"] [--out results/buckets_vs_dynamic.json]

Both run every request, interleaved (alternating which goes first), so the machine's noise
hits both alike. Bucket executables are compiled and run once before the clock starts (as a
server's warm-up would; those times are reported apart). The timed loop stops after --budget
seconds or --requests requests. Reported: throughput of each
(requests/s and rows/s), the ratio of total times, and the median of per-request ratios.
The default run takes a minute or two: the bucket builds, then at most `--budget` seconds.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from _results import Recorder, add_arguments, row  # benchmarks/ is the script's own directory

import kiln
from kiln.ir.inputs import synthesize
from kiln.runtime import buckets as bk


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="zoo:bert-base")
    parser.add_argument("--backend", default="ort")
    parser.add_argument("--buckets", default="batch=1,2,4,8,16 seq=32,64,128,256")
    parser.add_argument("--batch", default="1,16", help="min,max batch")
    parser.add_argument("--seq", default="8,256", help="min,max sequence length")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--budget", type=float, default=60.0, help="seconds of timed runs")
    parser.add_argument("--out", default="results/buckets_vs_dynamic.json")
    add_arguments(parser)
    args = parser.parse_args()
    recorder = Recorder("buckets_vs_dynamic")
    rng = np.random.default_rng(0)
    (b0, b1), (s0, s1) = (map(int, args.batch.split(",")), map(int, args.seq.split(",")))
    shapes = [
        (int(rng.integers(b0, b1 + 1)), int(rng.integers(s0, s1 + 1))) for _ in range(args.requests)
    ]

    start = time.perf_counter()
    # ORT thread pools that spin after a run steal the cores from the other session's next
    # run when two sessions alternate (measured: 13% at 4x128); bucket sessions never spin,
    # so neither does the dynamic one here.
    quiet = {"spinning": False} if args.backend == "ort" else {}
    bucketed = kiln.Session(args.model, buckets=args.buckets, backend=args.backend, options=quiet)
    dynamic = bucketed.executable  # the engine's own session, dynamic shapes, as-is
    load_s = time.perf_counter() - start
    # Off the clock, as a server's warm-up would: compile the buckets the requests need and
    # run each once (a first run allocates); the dynamic session runs the largest shape once.
    start = time.perf_counter()
    state = bucketed._state
    keys = {bucketed._route(state, {"batch": b, "seq": s}) for b, s in shapes} - {None}
    for key in keys:
        bucketed._runner(state, key)
    compile_s = time.perf_counter() - start
    for key in keys:
        size = dict(key)
        bucketed._runner(state, key).run(request(bucketed, size["batch"], size["seq"]), None)
    dynamic.run(request(bucketed, max(b for b, _ in shapes), max(s for _, s in shapes)))
    warm_s = time.perf_counter() - start - compile_s

    times = {"buckets": [], "dynamic": []}
    done, rows = 0, 0
    loop_start = time.perf_counter()
    for i, (batch, seq) in enumerate(shapes):
        if time.perf_counter() - loop_start > args.budget:
            break
        feeds = request(bucketed, batch, seq)
        order = ["buckets", "dynamic"] if i % 2 == 0 else ["dynamic", "buckets"]
        for name in order:
            t = time.perf_counter()
            if name == "buckets":
                bucketed.run(None, feeds)
            else:
                dynamic.run(feeds)
            times[name].append(time.perf_counter() - t)
        done, rows = done + 1, rows + batch
    bucketed.close()

    total = {k: float(np.sum(v)) for k, v in times.items()}
    per_request = np.array(times["dynamic"]) / np.array(times["buckets"])
    stats = bucketed.stats()
    result = {
        "model": args.model,
        "backend": args.backend,
        "buckets": bk.parse_buckets(args.buckets),
        "requests": done,
        "rows": rows,
        "load_s": load_s,
        "compile_s": compile_s,
        "warm_s": warm_s,
        "executables": len(keys),
        "throughput_rps": {k: done / v for k, v in total.items()},
        "rows_per_s": {k: rows / v for k, v in total.items()},
        "speedup_total": total["dynamic"] / total["buckets"],
        "speedup_median_per_request": float(np.median(per_request)),
        "padding_waste": stats["padding_waste"],
        "misses": stats["misses"],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    label = f"{args.model} on {args.backend}"
    recorder.write([
        row(f"{label}: total time dynamic ÷ buckets", result["speedup_total"], "x",
            model=args.model, engine="kiln buckets", baseline=f"{args.backend} dynamic"),
        row(f"{label}: median per-request ratio", result["speedup_median_per_request"], "x",
            model=args.model, engine="kiln buckets", baseline=f"{args.backend} dynamic"),
    ], result, args.results)  # fmt: skip


def request(session: kiln.Session, batch: int, seq: int) -> dict[str, np.ndarray]:
    """Token ids inside the model's vocabulary, masks of ones (kiln's own input synthesis)."""
    return synthesize(session.interface, dims={"batch": batch, "seq": seq}, seed=batch * seq)


if __name__ == "__main__":
    main()
