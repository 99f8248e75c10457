"""`kiln serve`'s memory under a stream of rejected oversized requests.

    python benchmarks/serve_rejected_memory.py [--artifact bert-tiny.kiln] [--requests 100]
        [--seq 1200000] [--out results/serve_rejected_memory.json]

Serves a bert-tiny artifact (built with `kiln optimize zoo:bert-tiny` when none is given) with
`kiln serve` as a subprocess, then sends `--requests` JSON requests of three INT64 inputs
[1, SEQ] (SEQ=1200000: a 10.8 MB body, under the 64 MiB limit), one after another. Each must
be answered 400. The server's RSS is read (psutil) after the first answer and after the last;
the figure of merit is their ratio, which must stay within 1.10. Prints the command, machine,
versions and figures, and writes them as JSON and the result file. The default run (the
bert-tiny build, then 100 requests) takes about a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import onnxruntime
import psutil
from _machine import machine  # benchmarks/ is the script's own directory
from _results import Recorder, add_arguments, row  # benchmarks/ is the script's own directory

import kiln
from kiln.hardware import cpu_info

INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def body(seq: int) -> bytes:
    zeros = "[" + ", ".join(["0"] * seq) + "]"  # 3 bytes a value, as a JSON client writes them
    tensors = ",".join(
        f'{{"name": "{n}", "datatype": "INT64", "shape": [1, {seq}], "data": {zeros}}}'
        for n in INPUTS
    )
    return f'{{"inputs": [{tensors}]}}'.encode()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--artifact", default=None)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--seq", type=int, default=1_200_000)
    parser.add_argument("--feedback", action="store_true", help="serve with --feedback")
    parser.add_argument("--out", default="results/serve_rejected_memory.json")
    add_arguments(parser)
    args = parser.parse_args()
    recorder = Recorder("serve_rejected_memory")
    work = Path(tempfile.mkdtemp(prefix="kiln-rss-"))
    env = {**os.environ, "KILN_HOME": os.environ.get("KILN_HOME", str(work / "home"))}
    artifact = args.artifact
    if artifact is None:
        artifact = str(work / "bert-tiny.kiln")
        subprocess.run(
            [sys.executable, "-m", "kiln", "optimize", "zoo:bert-tiny", "-o", artifact],
            env=env, check=True, capture_output=True,
        )  # fmt: skip
    command = [sys.executable, "-m", "kiln", "serve", artifact, "--port", "0", "--json"]
    command += ["--feedback"] if args.feedback else []
    server = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
    try:
        ready = json.loads(server.stdout.readline())
        url = f"{ready['url']}/infer"
        process = psutil.Process(server.pid)
        payload = body(args.seq)
        statuses, rss_mb, errors = [], [], set()
        start = time.perf_counter()
        with httpx.Client(timeout=600) as client:
            meta = client.get(ready["url"]).json()
            for _ in range(args.requests):
                response = client.post(url, content=payload)
                statuses.append(response.status_code)
                errors.add(response.json().get("error", "")[:200])
                rss_mb.append(process.memory_info().rss / 2**20)
        seconds = time.perf_counter() - start
    finally:
        server.terminate()
        server.wait(60)
    cpu = cpu_info()
    print(f"{cpu.model}, {cpu.logical_cores} cores, {platform.platform()}")
    result = {
        "command": " ".join(sys.argv),
        "machine": machine(),
        "versions": {
            "kiln": kiln.__version__,
            "onnxruntime": onnxruntime.__version__,
            "python": platform.python_version(),
        },  # fmt: skip
        "requests": args.requests,
        "body_mb": len(payload) / 1e6,
        "statuses": sorted(set(statuses)),
        "errors": sorted(errors),
        "metadata_inputs": meta.get("inputs"),
        "rss_mb_after_first": rss_mb[0],
        "rss_mb_after_last": rss_mb[-1],
        "rss_mb_max": max(rss_mb),
        "ratio_last_to_first": rss_mb[-1] / rss_mb[0],
        "seconds": seconds,
        "rss_mb_each": [round(r, 1) for r in rss_mb],
    }
    print(json.dumps({k: v for k, v in result.items()
                      if k not in ("metadata_inputs", "rss_mb_each")}, indent=2))  # fmt: skip
    print("RSS after each request (MB):", " ".join(f"{r:.0f}" for r in rss_mb))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    ratio = result["ratio_last_to_first"]
    answered = result["statuses"] == [400]
    recorder.write([
        row("server RSS after the last request ÷ after the first", ratio, "x",
            verdict="within 1.10" if ratio <= 1.10 else "over 1.10"),
        row("requests answered 400", args.requests if answered else None, "requests",
            verdict="pass" if answered else "fail"),
    ], result, args.results)  # fmt: skip


if __name__ == "__main__":
    main()
