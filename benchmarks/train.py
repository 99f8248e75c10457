"""What each `kiln.train` feature buys over a tutorial-style PyTorch loop.

    python benchmarks/train.py [--tasks lm,cnn] [--samples-lm 320] [--samples-cnn 6400]
        [--rows plain,bf16,...] [--slow-rows] [--json results/train.json]

The default run takes about 15 minutes on 2 cores. It leaves out the rows that run for hours
on CPUs without fp16 kernels (the CNN's fp16 convolutions: over 20 minutes there without
finishing); `--slow-rows` puts them back, and a row named in `--rows` always runs.

Tasks (real, offline): `lm` — kiln.train.examples:byte_lm_small (4 × 256, seq 256) on the
Python standard library's own source (split by file), global batch 8; `cnn` —
kiln.train.examples:digits_cnn_wide on scikit-learn's bundled digits, global batch 64.

Rows: `plain` is the loop the PyTorch tutorials write (fp32, one process, DataLoader with its
defaults, no checkpointing; AdamW lr 1e-3 wd 0.01 for the CNN, and for the LM AdamW lr 3e-4
with gradients clipped at norm 1, as PyTorch's word-language-model example clips — the same
recipe in every row); every other row is `kiln.train.fit` with
one feature of TrainConfig changed (bf16 autocast, fp16 + loss scaling, torch.compile,
accumulation, full activation checkpointing, DDP / FSDP2 / 1F1B pipeline on 2 gloo ranks,
loader workers + prefetch) and `combined` (bf16 + compile where the CPU has bf16 kernels, else
compile). Every row trains the same number of samples from the same seed (unless `--row-samples
fp16=320` shortens a row that would take hours: its figures then say so), each in a process of
its own (so one row's memory never counts against another), rows interleaved over `--rounds`.
Reported per row: samples/s in steady state (after `--warmup` steps, the median over rounds,
with the range), its ratio to plain, peak resident memory per rank and the part the training
itself adds (activations, gradients, optimizer state), and validation loss (LM) or accuracy
(CNN) after those samples. Prints the command, CPU line, versions and every figure; writes
JSON {"machine", "versions", "tasks": {NAME: {"rows": [{"feature", "samples_per_s", "speedup",
"peak_mib", "train_peak_mib", "val_loss" | "accuracy", ...}]}}} and the result file.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _results import Recorder, add_arguments, row  # benchmarks/ is the script's own directory

TASKS = {
    # The LM's recipe (AdamW lr 3e-4, gradients clipped at norm 1) is the task's, the same
    # in every row; see kiln.train.examples.lm_optimizer for why not the default lr 1e-3.
    "lm": {
        "model": "kiln.train.examples:byte_lm_small",
        "data": "kiln.train.examples:stdlib_text_small",
        "batch": 8,
        "metric": "val_loss",
        "optimizer": "kiln.train.examples:lm_optimizer",
        "clip": 1.0,
    },
    "cnn": {
        "model": "kiln.train.examples:digits_cnn_wide",
        "data": "kiln.train.examples:digits",
        "batch": 64,
        "metric": "accuracy",
        "optimizer": None,
        "clip": None,
    },  # fmt: skip
}
VAL_SAMPLES = 512  # validation windows/images every row is judged on
# (task, feature) rows that run for hours on CPUs without fp16 kernels: opt-in
SLOW_ROWS = (("cnn", "fp16"),)
ROWS = ("plain", "fp32", "bf16", "fp16", "compile", "accumulation", "checkpointing", "ddp",
        "fsdp2", "pipeline", "loader", "combined")  # fmt: skip


def row_config(feature: str, batch: int, bf16_kernels: bool) -> dict[str, Any]:
    """The TrainConfig (as changes to the defaults) of one row, at global batch `batch`."""
    two = {"ranks": 2, "threads_per_rank": 1}
    rows: dict[str, dict[str, Any]] = {
        "fp32": {},
        "bf16": {"precision": "bf16"},
        "fp16": {"precision": "fp16"},
        "compile": {"compile": "default"},
        "accumulation": {"micro_batch": batch // 2, "accumulation": 2},
        "checkpointing": {"checkpointing": {"policy": "full"}},  # the model's repeated blocks
        "ddp": {"micro_batch": batch // 2, "parallel": {"strategy": "ddp", **two}},
        "fsdp2": {"micro_batch": batch // 2, "parallel": {"strategy": "fsdp2", **two}},
        "pipeline": {"parallel": {"strategy": "pipeline", "microbatches": 4, **two}},
        "loader": {"loader": {"workers": 1, "prefetch_factor": 4, "persistent_workers": True}},
        "combined": {"precision": "bf16", "compile": "default"}
        if bf16_kernels
        else {"compile": "default"},
    }
    return {"micro_batch": batch, **rows[feature]}


# ------------------------------------------------------------------------- one row, in a child


def run_row(task: str, feature: str, samples: int, warmup: int,
            tuned: str | None = None) -> dict[str, Any]:  # fmt: skip
    """Train one row; its figures (this runs in a process of its own). `tuned`: the config
    file `kiln train --tune -o FILE` wrote, for the row "tuned"."""
    spec = TASKS[task]
    steps = max(warmup + 2, samples // spec["batch"])
    if feature == "plain":
        return _plain(spec, steps, warmup)
    from kiln.compress.loading import load_callable
    from kiln.hardware import cpu_info
    from kiln.train import TrainConfig, fit

    features = cpu_info().features
    bf16 = bool({"avx512_bf16", "amx_bf16"} & set(features))
    if feature == "tuned":
        from kiln.train import read_config

        config = read_config(tuned) if tuned else None
        if config is None or config.global_batch != spec["batch"]:
            raise SystemExit(f"row tuned: give --tuned-{task} FILE of global batch {spec['batch']}")
    else:
        config = TrainConfig().replace(**row_config(feature, spec["batch"], bf16))
    config = config.replace(clip_grad_norm=spec["clip"])  # the task's recipe, not a decision
    optimizer = load_callable(spec["optimizer"], "optimizer") if spec["optimizer"] else None
    record = fit(load_callable(spec["model"], "model"), _data(spec), optimizer=optimizer,
                 config=config, steps=steps)  # fmt: skip
    return _figures(record["step_seconds"], spec["batch"], warmup, record["peak_mib"],
                    record["train_peak_mib"], record.get("val") or {})  # fmt: skip


def _plain(spec: dict[str, Any], steps: int, warmup: int) -> dict[str, Any]:
    """The tutorial loop: fp32, one process, DataLoader(shuffle=True), AdamW."""
    import torch

    from kiln.compress.loading import load_callable
    from kiln.runtime import footprint
    from kiln.train.loop import cross_entropy
    from kiln.train.watch import validate as _validate

    torch.manual_seed(0)
    model = load_callable(spec["model"], "model")()
    data = _data(spec)
    if spec["optimizer"]:
        optimizer = load_callable(spec["optimizer"], "optimizer")(model.parameters())
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    loader = torch.utils.data.DataLoader(data["train"], batch_size=spec["batch"], shuffle=True)
    footprint.reset_peak()
    resident = footprint.rss_mib()
    times, started, step = [], time.perf_counter(), 0
    while step < steps:
        for x, y in loader:
            loss = cross_entropy(model(x), y)
            loss.backward()
            if spec["clip"]:
                torch.nn.utils.clip_grad_norm_(model.parameters(), spec["clip"])
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            times.append(time.perf_counter() - started)
            if step >= steps:
                break
    peak = footprint.peak_rss_mib()

    class _Plain:  # what _validate reads of a Prepared
        def __init__(self) -> None:
            from kiln.train import TrainConfig

            self.model, self.pipeline = model, None
            self.config = TrainConfig(micro_batch=spec["batch"])

        def autocast(self) -> Any:
            import contextlib

            return contextlib.nullcontext()

    val = _validate(_Plain(), data["val"], cross_entropy)  # type: ignore[arg-type]
    return _figures(times, spec["batch"], warmup, {"0": peak}, {"0": peak - resident}, val or {})


def _data(spec: dict[str, Any]) -> dict[str, Any]:
    """The task's splits, validation cut to its first VAL_SAMPLES (the same for every row)."""
    from torch.utils.data import Subset

    from kiln.compress.loading import load_callable

    data = load_callable(spec["data"], "data")()
    val = data["val"]
    return {"train": data["train"], "val": Subset(val, range(min(len(val), VAL_SAMPLES)))}


def _figures(times: list[float], batch: int, warmup: int, peak: dict, train_peak: dict,
             val: dict) -> dict[str, Any]:  # fmt: skip
    steady = times[-1] - times[warmup - 1] if warmup > 0 else times[-1]
    counted = len(times) - warmup
    return {"samples_per_s": counted * batch / steady, "steps": len(times),
            "samples": len(times) * batch, "seconds": times[-1],
            "peak_mib": peak, "train_peak_mib": train_peak,
            "val_loss": val.get("loss"), "accuracy": val.get("accuracy")}  # fmt: skip


# ------------------------------------------------------------------------- the parent


def child(task: str, feature: str, samples: int, warmup: int, timeout: float,
          tuned: str | None) -> dict[str, Any]:  # fmt: skip
    command = [sys.executable, __file__, "--row", f"{task}:{feature}", "--samples-lm",
               str(samples), "--samples-cnn", str(samples), "--warmup", str(warmup),
               *([f"--tuned-{task}", tuned] if tuned else [])]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"no result in {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": tail[:300]}
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", default="lm,cnn")
    parser.add_argument("--rows", default=None, help=f"default: {','.join(ROWS)}")
    parser.add_argument("--slow-rows", action="store_true",
                        help="also the rows that take hours: " + ", ".join(
                            f"{task} {feature}" for task, feature in SLOW_ROWS))  # fmt: skip
    parser.add_argument("--samples-lm", type=int, default=320)
    parser.add_argument("--samples-cnn", type=int, default=6400)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of samples/s")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", default="results/train.json")
    parser.add_argument("--tuned-lm", help="kiln train --tune -o FILE for the lm task")
    parser.add_argument("--tuned-cnn", help="kiln train --tune -o FILE for the cnn task")
    parser.add_argument(
        "--row-samples",
        default="",
        help="FEATURE=N,...: train these rows on N samples only (e.g. fp16 "
        "on CPUs without fp16 kernels); their accuracy is not comparable",
    )
    parser.add_argument("--row", help=argparse.SUPPRESS)  # internal: one row in this process
    add_arguments(parser)
    args = parser.parse_args()
    if args.row:
        task, feature = args.row.split(":")
        samples = args.samples_lm if task == "lm" else args.samples_cnn
        tuned = getattr(args, f"tuned_{task}")
        print(json.dumps(run_row(task, feature, samples, args.warmup, tuned)))
        return
    import torch
    from _machine import machine  # benchmarks/ is the script's own directory

    import kiln
    from kiln.hardware import cpu_info

    recorder = Recorder("train")
    cpu = cpu_info()
    result: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "versions": {
            "kiln": kiln.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },  # fmt: skip
        "tasks": {},
    }
    print(result["command"])
    print(f"{cpu.model}, {cpu.logical_cores} cores, {' '.join(cpu.features)}")
    print(f"kiln {kiln.__version__}, torch {torch.__version__}")
    for task in args.tasks.split(","):
        tuned = getattr(args, f"tuned_{task}")
        rows = chosen_rows(task, args.rows, args.slow_rows) + (["tuned"] if tuned else [])
        samples = args.samples_lm if task == "lm" else args.samples_cnn
        shortened = {f: int(n) for f, _, n in (item.partition("=") for item in
                                                args.row_samples.split(",") if item)}  # fmt: skip
        runs: dict[str, list[dict[str, Any]]] = {r: [] for r in rows}
        for round_ in range(args.rounds):  # rows interleaved: round after round
            order = rows[round_ % len(rows) :] + rows[: round_ % len(rows)]
            for feature in order:
                runs[feature].append(child(task, feature, shortened.get(feature, samples),
                                           args.warmup, args.timeout, tuned))  # fmt: skip
                print(f"  {task} {feature} round {round_ + 1}: {_short(runs[feature][-1])}",
                      flush=True)  # fmt: skip
        result["tasks"][task] = {"samples": samples, "batch": TASKS[task]["batch"],
                                 "rows": _summarise(runs, TASKS[task]["metric"])}  # fmt: skip
        _print_task(task, result["tasks"][task], TASKS[task]["metric"])
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    recorder.write(train_rows(result["tasks"]), result, args.results)


def chosen_rows(task: str, given: str | None, slow: bool) -> list[str]:
    """The rows named, or every row but the slow ones unless `slow`."""
    if given:
        return given.split(",")
    left_out = [f for t, f in SLOW_ROWS if t == task and not slow]
    if left_out:
        print(f"{task}: {', '.join(left_out)} left out (hours on this kind of CPU; "
              "--slow-rows runs them)", flush=True)  # fmt: skip
    return [f for f in ROWS if f not in left_out]


def train_rows(tasks: dict[str, Any]) -> list[dict[str, Any]]:
    """Each feature's samples/s over the plain loop's, with its peak memory and metric."""
    found = []
    for task, summary in tasks.items():
        for item in summary["rows"]:
            if "error" in item:
                found.append(row(f"{task} {item['feature']}: over plain", None, "x",
                                 verdict="failed", model=task, engine=item["feature"]))  # fmt: skip
                continue
            found.append(row(
                f"{task} {item['feature']}: samples/s over plain", item["speedup"], "x",
                model=task, engine=item["feature"], baseline="plain",
                samples_per_s=item["samples_per_s"],
                peak_mib=max(item["peak_mib"].values(), default=None),
            ))  # fmt: skip
    return found


def _summarise(runs: dict[str, list[dict[str, Any]]], metric: str) -> list[dict[str, Any]]:
    base = _median([r["samples_per_s"] for r in runs.get("plain", []) if "error" not in r])
    rows = []
    for feature, results in runs.items():
        good = [r for r in results if "error" not in r]
        if not good:
            rows.append({"feature": feature, "error": results[0]["error"] if results else "none"})
            continue
        rates = [r["samples_per_s"] for r in good]
        rate = _median(rates)
        last = good[-1]
        rows.append({
            "feature": feature, "samples_per_s": rate, "range": [min(rates), max(rates)],
            "speedup": rate / base if base else None, "peak_mib": last["peak_mib"],
            "train_peak_mib": last["train_peak_mib"], metric: last.get(metric),
            "samples": last.get("samples"),
        })  # fmt: skip
    return rows


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _short(figures: dict[str, Any]) -> str:
    if "error" in figures:
        return f"error: {figures['error']}"
    return f"{figures['samples_per_s']:.2f} samples/s, peak {figures['peak_mib']}"


def _print_task(task: str, summary: dict[str, Any], metric: str) -> None:
    print(f"\n{task}: {summary['samples']} samples, global batch {summary['batch']}")
    print(f"{'feature':14} {'samples/s':>10} {'×plain':>7} {'peak MiB/rank':>16} "
          f"{'train MiB':>10} {metric:>9}")  # fmt: skip
    for item in summary["rows"]:
        if "error" in item:
            print(f"{item['feature']:14} error: {item['error']}")
            continue
        peaks = "/".join(f"{v:.0f}" for v in item["peak_mib"].values())
        train = "/".join(f"{v:.0f}" for v in item["train_peak_mib"].values())
        value = item.get(metric)
        shown = f"{value:.4f}" if isinstance(value, float) else "–"
        short = f"  (after {item['samples']} samples)" if item.get("samples") != summary[
            "samples"] and item.get("samples") else ""  # fmt: skip
        print(f"{item['feature']:14} {item['samples_per_s']:10.2f} {item['speedup'] or 0:7.2f} "
              f"{peaks:>16} {train:>10} {shown:>9}{short}")  # fmt: skip


if __name__ == "__main__":
    main()
