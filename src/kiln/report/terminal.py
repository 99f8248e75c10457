"""Terminal views: one function per verb's table, each taking the verb's data and a Console.

The data is what the verb prints with `--json`, so the table and the JSON never disagree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kiln.errors import counted
from kiln.hardware.jitter import PARALLEL_PROBE
from kiln.timing import MIN_RUNS_FOR_P99

TOP_FINDINGS = 5
TOP_NODES = 5
# kiln doctor: other processes taking more than this share of the cores while the peaks
# were measured make every peak suspect (a GEMM on 2 cores loses what they take)
BUSY_SHARE = 0.25


def print_profile(result: dict[str, Any], console: Console) -> None:
    latency, node_time, roof = result["latency"], result["node_time"], result["roofline"]
    console.print(
        f"[bold]{escape(result['source'])}[/bold] on {escape(result['backend']['name'])}, "
        f"batch {result['batch']}: P50 {latency['p50_ms']:.2f} ms, P90 {latency['p90_ms']:.2f}, "
        f"P99 {latency['p99_ms']:.2f}, jitter {latency['jitter']:.2f}"
    )
    console.print(
        f"per-node sum {node_time['median_ms']:.2f} ms per run "
        f"({node_time['ratio_to_p50']:.0%} of the end-to-end P50{_profiled(node_time)}) · "
        f"{roof['achieved_gflops']:.1f} GFLOP/s = {roof['fraction_of_peak']:.0%} of the "
        f"{roof.get('peak_precision', 'fp32')} peak · {roof['fraction_of_roofline']:.0%} of the "
        "roofline · "
        f"peak RSS {result['memory']['model_peak_mib']:.0f} MiB"
    )
    plan = result.get("memory_plan") or {}
    if "live_peak_mib" in plan:
        console.print(
            f"activation peak (plan) {mib(plan['live_peak_mib'])} MiB, greedy arena "
            f"{mib(plan['greedy_arena_mib'])} MiB, measured {mib(plan['measured_peak_mib'])} MiB "
            "(first-run growth)"
        )
    if roof.get("note"):
        console.print(f"[yellow]{escape(roof['note'])}[/yellow]")
    table = Table(title="top bottlenecks", show_lines=True)
    table.add_column("#", justify="right")
    table.add_column("bottleneck")
    table.add_column("share", justify="right")
    table.add_column("evidence", overflow="fold")
    table.add_column("Kiln action", overflow="fold")
    for index, finding in enumerate(result["findings"][:TOP_FINDINGS], 1):
        table.add_row(
            str(index),
            escape(finding["title"]),
            f"{finding['share']:.1%}",
            escape(finding["evidence"]),
            escape(finding["action"]),
        )
    console.print(table)
    nodes = Table(title="slowest kernels")
    shown = result["nodes"][:TOP_NODES]
    traced = any(node.get("module") or node.get("source") for node in shown)
    columns = ("kernel", "op", "ms/run", "share", "original nodes") + ("module · source",) * traced
    for column in columns:
        nodes.add_column(column, overflow="fold")
    for node in shown:
        cells = [
            escape(node["node"]),
            escape(node["op_type"]),
            f"{node['median_ms']:.3f}",
            f"{node['share']:.1%}",
            escape(", ".join(node["original"][:6]) + (" …" if len(node["original"]) > 6 else "")),
        ]
        nodes.add_row(*cells, *[escape(module_and_source(node))] * traced)
    console.print(nodes)


def mib(value: float) -> str:
    """MiB with the digits a size needs: a tiny model's tensors are a few KiB."""
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.1f}" if abs(value) >= 1 else f"{value:.3f}"


def module_and_source(row: dict[str, Any], most: int = 3) -> str:
    """`encoder.layer.0.attention.self · modeling_bert.py:338`: the PyTorch modules and source
    lines behind a row (a file's name only; --json has the whole path)."""
    lines = list(dict.fromkeys(Path(s).name for s in row.get("source") or []))
    parts = [_first(row.get("module") or [], most), _first(lines, most)]
    return " · ".join(part for part in parts if part)


def _first(items: list[str], most: int) -> str:
    return ", ".join(items[:most]) + (" …" if len(items) > most else "")


def _profiled(node_time: dict) -> str:
    if node_time.get("ratio_to_profiled") is None:
        return ""
    return (
        f"; {node_time['ratio_to_profiled']:.0%} of the profiled runs' own time, the profiler "
        f"adding {node_time['profiler_overhead']:+.0%}"
    )


def print_zoo_list(entries: list[dict[str, Any]], console: Console) -> None:
    """`kiln zoo list`: name and description of each built-in model."""
    table = Table("name", "description", title="Kiln model zoo")
    for e in entries:
        table.add_row(e["name"], e["description"])
    console.print(table)


def print_zoo_info(info: dict[str, Any], console: Console) -> None:
    """`kiln zoo info`: interface, size, FLOPs and bytes against the published figure."""
    table = Table(show_header=False, title=f"zoo:{info['name']}")
    for key in ("description", "dims", "parameters", "nodes", "opset", "inputs", "outputs"):
        table.add_row(key, str(info[key]))
    table.add_row("GFLOPs (2×MAC)", f"{info['mac_gflops']:.3f} (matrix products, as papers count)")
    table.add_row("GFLOPs (all ops)", f"{info['gflops']:.3f}")
    table.add_row("GB moved", f"{info['gbytes']:.3f} (inputs, weights, outputs of every node)")
    table.add_row("intensity", f"{info['intensity']:.1f} FLOP/byte")
    if info["unknown_ops"]:
        table.add_row("not costed", ", ".join(info["unknown_ops"]))
    if info["published_gflops"]:
        table.add_row(
            "published", f"{info['published_gflops']:.3f} = 2 × MACs ({info['published_source']})"
        )
        table.add_row("deviation", f"{info['deviation']:+.2%} (2×MAC GFLOPs vs published 2×MACs)")
    console.print(table)


def print_doctor(info: dict[str, Any], console: Console) -> None:
    """`kiln doctor`: versions, CPU, engines found and the measured peaks."""
    cpu, peaks = info["cpu"], info["peaks"]
    table = Table(show_header=False, title="kiln doctor")
    table.add_row("python", info["python"])
    table.add_row("kiln", info["kiln"])
    table.add_row("platform", info["platform"])
    table.add_row("cpu", cpu["model"])
    if cpu.get("class"):  # the class benchmark results are filed under (docs/benchmarks/)
        table.add_row("cpu class", cpu["class"])
    table.add_row("cores", f"{cpu['physical_cores']} physical, {cpu['logical_cores']} logical")
    table.add_row("ISA features", " ".join(cpu["features"]) or "(none of interest)")
    for name, desc in info["engines"].items():
        table.add_row(f"engine {name}", " ".join(f"{k}={v}" for k, v in desc.items()))
    none = "(no kernels here)"
    bf16, int8 = peaks["bf16_gflops"], peaks["int8_gops"]
    table.add_row(
        "peak fp32", f"{peaks['fp32_gflops']:,.0f} GFLOP/s (GEMM, {peaks['threads']} threads)"
    )
    table.add_row("peak bf16", f"{bf16:,.0f} GFLOP/s" if bf16 else none)
    table.add_row("peak int8", f"{int8:,.0f} GOP/s" if int8 else none)
    table.add_row("memory bandwidth", f"{peaks['bandwidth_gbs']:,.1f} GB/s")
    when = f"{peaks['measured_at']} (kiln doctor --refresh re-measures)"
    load, others = peaks.get("load_average"), peaks.get("others_busy")
    if others is not None and others > BUSY_SHARE:
        when += f"; other processes took {others:.0%} of the cores meanwhile: peaks may be low"
    elif others is None and load is not None and load > 0.5 * cpu["logical_cores"]:
        when += f"; the machine was busy (load {load:.1f}): peaks may be low"
    table.add_row("peaks measured", when)
    console.print(table)
    if info.get("jitter_floor"):
        console.print(jitter_floor_table(info["jitter_floor"]))


def jitter_floor_table(floor: dict[str, Any]) -> Table:
    """The fixed-work probes' P50, P99 and jitter (with its bootstrap interval) and the floor:
    the least tail any work shows on this machine, the yardstick for every other jitter."""
    table = Table(
        "probe", "work", "runs", "P50 ms", "P99 ms", "jitter", "95 % interval",
        title=f"jitter floor {floor['floor']:.2f} ({escape(floor['probe'])}), measured "
        f"{escape(floor['measured'])}",
    )  # fmt: skip
    for name, probe in floor["probes"].items():
        low, high = probe["jitter_interval"]
        table.add_row(
            escape(name), escape(probe["work"]), f"{probe['runs']:,} in {probe['windows']} windows",
            ms(probe["p50_ms"]), ms(probe["p99_ms"]), f"{probe['jitter']:.2f}",
            f"{low:.2f}–{high:.2f}",
        )  # fmt: skip
    table.caption = "jitter = (P99 − P50) / P50; the floor is the lower of the probes' jitters"
    return table


def print_optimize(summary: dict[str, Any], console: Console) -> None:
    """`kiln optimize`: passes, nodes, precision, verification and timing of the artifact."""
    table = Table(title=f"kiln optimize → {escape(summary['artifact'])}", show_header=True)
    table.add_column("what")
    table.add_column("result", overflow="fold")
    _pass_rows(table, summary)
    nodes = summary["nodes"]
    table.add_row("nodes", f"{nodes['before']} → {nodes['after']}")
    table.add_row("backend", escape(summary["backend"]["name"]))
    _precision_rows(table, summary["precision"])
    for note in summary.get("notes") or []:  # options given and not used, and what was used
        table.add_row("note", escape(note))
    _verification_rows(table, summary["verification"])
    _bench_rows(table, summary["benchmark"])
    if summary.get("advice"):
        table.add_row("[yellow]next[/yellow]", f"[yellow]{escape(summary['advice'])}[/yellow]")
    if summary.get("replaced"):
        what = summary.get("replaced_what") or "artifact"
        table.add_row("artifact", escape(f"replaced the {what} at {summary['artifact']}"))
    console.print(table)


def _pass_rows(table: Table, summary: dict[str, Any]) -> None:
    rewrites: dict[str, int] = {}
    for p in summary["passes"]:  # simplify and refine-shapes run several times
        rewrites[p["name"]] = rewrites.get(p["name"], 0) + p["rewrites"]
    notes = {p["name"]: p["note"] for p in summary["passes"] if p.get("note")}
    for name, count in rewrites.items():
        if count:
            table.add_row(f"pass {name}", counted(count, "rewrite"))
        elif name in notes:
            table.add_row(f"pass {name}", escape(notes[name]))
    for name in summary["dropped_passes"]:
        table.add_row(f"pass {name}", "[red]dropped: it broke the outputs or crashed[/red]")


def _precision_rows(table: Table, precision: dict[str, Any]) -> None:
    nodes = precision.get("nodes", {})
    kept = {n: p.split(" ")[0] for n, p in nodes.items() if not p.startswith(precision["default"])}
    if precision["default"] != "fp32":
        shown = ", ".join(f"{n} ({p})" for n, p in list(kept.items())[:12])
        more = f" and {len(kept) - 12} more (see manifest.json)" if len(kept) > 12 else ""
        table.add_row(
            "precision",
            escape(f"{precision['default']} ({precision.get('scheme', '')}); kept higher: ")
            + escape((shown or "none") + more),
        )
    warning = (precision.get("calibration") or {}).get("warning")
    if warning:
        table.add_row("[yellow]warning[/yellow]", f"[yellow]{escape(warning)}[/yellow]")


def _verification_rows(table: Table, verification: dict[str, Any] | None) -> None:
    if verification is None:
        table.add_row("verification", "[yellow]skipped (--no-verify)[/yellow]")
    else:
        table.add_row(
            "verification",
            ("[green]passed[/green]" if verification["ok"] else "[red]FAILED[/red]")
            + escape(f" ({verification['precision']}, inputs: {verification['inputs']})"),
        )
        if verification.get("metric"):
            table.add_row(
                "  accuracy budget",
                escape(
                    f"{verification['metric']} {verification['score']:.5f} ≥ "
                    f"{verification['threshold']:.5f} (the worst sample judged)"
                ),
            )
            if verification.get("note"):
                table.add_row("  budget read as", escape(verification["note"]))
        for o in verification["outputs"]:
            if o.get("cosine") is not None:
                text = f"cosine {o['cosine']:.5f}, max abs {o['max_abs']:.1e}"
            else:
                text = f"max abs {o['max_abs']:.1e} ≤ {o['bound']:.1e}, max rel {o['max_rel']:.1e}"
            table.add_row(f"  output {o['name']}", text)


def _bench_rows(table: Table, bench: dict[str, Any] | None) -> None:
    memory = (bench or {}).get("peak_rss_mib")
    if memory:
        table.add_row(
            "peak memory",
            f"{memory['run']:,.0f} MiB running ({memory['load']:,.0f} MiB opened, "
            f"{memory['steady']:,.0f} MiB steady); compiling took {memory['compile']:,.0f} MiB",
        )
    if bench:
        for key, label in (("original_ort", "original, ORT_ENABLE_ALL"), ("artifact", "artifact")):
            s = bench[key]
            table.add_row(
                label,
                f"P50 {ms(s['p50_ms'])} ms  P99 {ms(s['p99_ms'])} ms  jitter {s['jitter']:.2f}",
            )
        if "p99_runs" in bench:
            table.add_row("P99", escape(f"the artifact's P99 is from {p99_backing_note(bench)}"))
        table.add_row(
            "speedup",
            format_speedup(bench["speedup"], bench.get("speedup_spread"), bench.get("verdict"))
            + f" over {bench['rounds']} rounds",
        )
        verdicts = bench.get("candidate_verdicts") or {}
        if len(bench["candidates"]) > 1:
            table.add_row(
                "candidates",
                ", ".join(
                    f"{k} " + format_speedup(v, **_spread_of(verdicts.get(k)), color=False)
                    for k, v in bench["candidates"].items()
                ),
            )
        if bench.get("choice_reason") and len(bench["candidates"]) > 1:
            table.add_row("chosen", escape(f"{bench['choice']}: {bench['choice_reason']}"))
        for name, why in bench.get("refused", {}).items():
            table.add_row(f"[yellow]refused {name}[/yellow]", escape(why))


VERDICT_STYLE = {"faster": "green", "slower": "red", "no different within noise": "yellow"}


def ms(value: float) -> str:
    """A latency in ms with enough digits that two P50s never look equal or reversed when
    their ratio says otherwise (0.143 vs 0.132, 117.40 vs 123.50)."""
    return f"{value:#.3g}" if value < 1 else f"{value:.2f}"


def format_speedup(
    value: float, spread: list[float] | None = None, verdict: str | None = None, color: bool = True
) -> str:
    """`1.62× (1.55–1.70, faster)`; `1.87× (spread unknown: fewer than 3 rounds)`; markup."""
    if verdict == "baseline":
        return f"{value:.2f}× (baseline)"
    if not spread:
        return f"{value:.2f}× (spread unknown: fewer than 3 rounds)"
    said = escape(verdict or "")
    style = VERDICT_STYLE.get(verdict or "") if color else None
    if style:
        said = f"[{style}]{said}[/{style}]"
    return f"{value:.2f}× ({spread[0]:.2f}–{spread[1]:.2f}, {said})"


def _spread_of(verdict: dict | None) -> dict:
    if not verdict:
        return {}
    return {"spread": verdict.get("speedup_spread"), "verdict": verdict.get("verdict")}


def _peaks(peak: dict[str, float] | None) -> str:
    return f"{peak['load']:.0f} / {peak['run']:.0f}" if peak else "—"


def print_bench(result: dict[str, Any], console: Console) -> None:
    """`kiln bench`: the command, machine and versions, then one row per engine."""
    console.print(f"[dim]{escape(result['command'])}[/dim]")
    machine = result["machine"]
    versions = " ".join(f"{k} {v}" for k, v in result["versions"].items())
    console.print(
        f"[dim]{result['date']} · {machine['cpu']} · {machine['cores']} cores · {versions}[/dim]"
    )
    title = (
        f"kiln bench {escape(result['model'])} (batch {result['batch']}, "
        f"{result['rounds']} rounds × {result['runs_per_round']} runs, interleaved)"
    )
    columns = ["P50 ms", "P90 ms", "P99 ms", "jitter (× floor)", "CQI (of peak)", "samples/s",
               f"× vs {escape(result['baseline'])}", "per-round range", "verdict",
               "cosine vs fp32", "peak MiB load / run", "weights MiB"]  # fmt: skip
    rows = {name: _bench_cells(e) for name, e in result["engines"].items()}
    if console.width >= WIDE_BENCH_COLUMNS:  # an engine a row
        table = Table("engine", *columns, title=title)
        for name, cells in rows.items():
            table.add_row(escape(name), *cells)
    else:  # a narrow terminal or a log: an engine a column, so that every figure shows whole
        table = Table("", *(escape(name) for name in rows), title=title)
        for i, column in enumerate(columns):
            table.add_row(column, *(cells[i] for cells in rows.values()))
    console.print(table)
    console.print(
        "[dim]P50: median of the per-round P50s; × = the baseline's P50 ÷ the engine's; the "
        "range is the lowest and highest per-round ratio: faster or slower only when every "
        "round agrees.[/dim]"
    )
    if result.get("jitter_floor"):
        console.print(f"[dim]{escape(_floor_note(result))}[/dim]")
    if "kiln" in result.get("steadiness", {}):
        console.print(escape(_steadiness_line(result["steadiness"]["kiln"], result["engines"])))
    if result.get("memory"):
        console.print(f"[dim]Memory: {escape(result['memory'])}.[/dim]")
    if result.get("advice"):
        console.print(f"[yellow]{escape(result['advice'])}[/yellow]")


# Below this many columns the bench table turns: an engine a column (13 columns of figures
# cannot show whole in an 80-column terminal).
WIDE_BENCH_COLUMNS = 160


def _bench_cells(e: dict[str, Any]) -> list[str]:
    """One engine's figures, in the table's column order."""
    spread, verdict = e.get("speedup_spread"), e.get("verdict") or ""
    style = VERDICT_STYLE.get(verdict)
    return [
        ms(e["p50_ms"]), ms(e["p90_ms"]), ms(e["p99_ms"]), _over_floor(e), _cqi(e),
        f"{e['throughput']:.1f}", f"{e['speedup_vs_baseline']:.2f}",
        f"{spread[0]:.2f}–{spread[1]:.2f}" if spread else "unknown (< 3 rounds)",
        f"[{style}]{escape(verdict)}[/{style}]" if style else escape(verdict),
        f"{e['cosine_vs_fp32']:.5f}", _peaks(e.get("peak_rss_mib")),
        f"{e['weights_mib']:.1f}" if "weights_mib" in e else "—",
    ]  # fmt: skip


def _over_floor(engine: dict[str, Any]) -> str:
    """An engine's jitter and how many times the host's floor it is, with that ratio's 95 %
    interval where there is one."""
    ratio = engine.get("jitter_over_floor")
    if ratio is None:
        return f"{engine['jitter']:.2f}"
    interval = engine.get("jitter_over_floor_interval")
    spread = "" if not interval else f", {interval[0]:.1f}–{interval[1]:.1f}"
    return f"{engine['jitter']:.2f} ({ratio:.1f}×{spread})"


def _steadiness_line(kiln: dict[str, Any], engines: dict[str, Any]) -> str:
    """Whether Kiln's jitter is the lowest in the run, within noise of the lowest, or above it."""
    rival = kiln["vs"]
    ratio, interval = kiln["jitter_ratio"], kiln["interval"]
    figure = "∞×" if ratio is None else f"{ratio:.2f}×"
    spread = f" (95 % interval {interval[0]:.2f}–{interval[1]:.2f})" if interval else ""
    said = {
        "steadiest": f"the lowest jitter of every engine here; the next, {rival}, is "
        f"{engines[rival]['jitter']:.2f}",
        "tied": f"no different within noise from the lowest, {rival}",
        "less steady": f"above the lowest, {rival}, beyond noise",
    }[kiln["verdict"]]
    return f"Steadiness: Kiln's jitter is {figure} {rival}'s{spread}: {said}."


def _cqi(engine: dict[str, Any]) -> str:
    """The CQI and the fraction of the peak it is built on (None: FLOPs or peaks unknown)."""
    if engine.get("cqi") is None:
        return "—"
    return f"{engine['cqi']:.3f} ({engine['roofline_fraction']:.1%})"


def _parallel_note(floor: dict[str, Any]) -> str:
    """The probe on every core, whose jitter engines using every core also stand beside."""
    probe = floor.get("probes", {}).get(PARALLEL_PROBE)
    if probe is None or probe["probe"] == floor["probe"]:
        return ""
    return (f" (fixed work on every core, {probe['probe']}, read {probe['jitter']:.2f}: JSON "
            "jitter_over_parallel_floor)")  # fmt: skip


def p99_backing_note(result: dict[str, Any]) -> str:
    """How many runs a P99 stands on (`kiln.timing.p99_backing`) and whether that backs it."""
    backed = (
        "backs" if result.get("p99_backed")
        else f"is below the {MIN_RUNS_FOR_P99} MLPerf needs to back"
    )  # fmt: skip
    return f"{result.get('p99_runs', '?')} runs, which {backed} a P99 at 99 % confidence"


def _floor_note(result: dict[str, Any]) -> str:
    """What the jitter and CQI columns stand beside: the floor measured in this run, how many
    runs back each P99, and what CQI is."""
    floor = result["jitter_floor"]
    low, high = floor["floor_interval"]
    return (
        f"Jitter floor of this host: {floor['floor']:.2f} ({floor['probe']}, 95 % interval "
        f"{low:.2f}–{high:.2f}), measured {floor['measured']}; "
        f"× floor = the engine's jitter ÷ the floor (its 95 % interval after the comma)"
        f"{_parallel_note(floor)}. Each engine's P99 "
        "is from "
        f"{p99_backing_note(result)}. "
        "CQI = fraction of the measured peak of the engine's precision (in brackets) × "
        "(1 − jitter), each clamped to [0, 1]."
    )
