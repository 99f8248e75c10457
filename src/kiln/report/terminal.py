"""The terminal view of a profile: headline figures and the top findings as a rich table."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

TOP_FINDINGS = 5
TOP_NODES = 5


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
        f"{roof['achieved_gflops']:.1f} GFLOP/s = {roof['fraction_of_peak']:.0%} of the fp32 "
        f"peak · {roof['fraction_of_roofline']:.0%} of the roofline · "
        f"peak RSS {result['memory']['model_peak_mib']:.0f} MiB"
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
    for column in ("kernel", "op", "ms/run", "share", "original nodes"):
        nodes.add_column(column, overflow="fold")
    for node in result["nodes"][:TOP_NODES]:
        nodes.add_row(
            escape(node["node"]),
            escape(node["op_type"]),
            f"{node['median_ms']:.3f}",
            f"{node['share']:.1%}",
            escape(", ".join(node["original"][:6]) + (" …" if len(node["original"]) > 6 else "")),
        )
    console.print(nodes)


def _profiled(node_time: dict) -> str:
    if node_time.get("ratio_to_profiled") is None:
        return ""
    return (
        f"; {node_time['ratio_to_profiled']:.0%} of the profiled runs' own time, the profiler "
        f"adding {node_time['profiler_overhead']:+.0%}"
    )
