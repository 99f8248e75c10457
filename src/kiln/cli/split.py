"""`kiln split`: a model cut into an edge part and a server part, the cut chosen from measured
times and the link's bandwidth, the boundary encoded under the accuracy budget."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from kiln.cli.console import JsonOpt, ModelArg, console, emit_json, progress

OutputOpt = Annotated[
    Path, typer.Option("-o", "--output", help="Directory for edge.kiln and server.kiln.")
]
AtOpt = Annotated[
    str,
    typer.Option(
        help="auto (least predicted end-to-end time), a node name, a tensor name, or "
        "tensors joined by ','."
    ),
]
BandwidthOpt = Annotated[
    str, typer.Option(help="The link between edge and server: 20Mbit/s, 1Gbit/s, 5MB/s.")
]
EdgeSlowdownOpt = Annotated[
    float | None,
    typer.Option(help="The edge is this many times slower than this machine (default 8)."),
]
EdgeProfileOpt = Annotated[
    Path | None,
    typer.Option(help="The edge's own times: the JSON `kiln profile MODEL --json` wrote there."),
]
CodecOpt = Annotated[
    str,
    typer.Option(
        help="What crosses the link: auto (fewest bytes within the accuracy budget), none, "
        "fp16, int8 (per-channel scales), topk or topk:FRACTION (sparse)."
    ),
]
InputsOpt = Annotated[
    Path | None,
    typer.Option("--inputs", help="Reference inputs (.npz, one array per input)."),
]
OverheadMsOpt = Annotated[
    float | None,
    typer.Option(
        help="A request's fixed cost on the link in ms (default: a null request's round "
        "trip on loopback, measured)."
    ),
]
ForceOpt = Annotated[
    bool, typer.Option(help="Replace -o even if it holds files kiln split did not write.")
]


def split(
    model: ModelArg, output: OutputOpt, at: AtOpt = "auto",
    bandwidth: BandwidthOpt = "20Mbit/s", edge_slowdown: EdgeSlowdownOpt = None,
    edge_profile: EdgeProfileOpt = None, codec: CodecOpt = "auto", inputs: InputsOpt = None,
    overhead_ms: OverheadMsOpt = None, force: ForceOpt = False, as_json: JsonOpt = False,
) -> None:  # fmt: skip
    """Split MODEL between an edge device and a server: DIR/edge.kiln runs on the edge
    (kiln.Session(edge, remote=URL)), DIR/server.kiln is served with `kiln serve`."""
    from kiln.split import split as split_model

    with progress() as bar:
        task = bar.add_task(f"loading {model}")
        result = split_model(
            model, at, output, bandwidth=bandwidth, edge_slowdown=edge_slowdown,
            edge_profile=edge_profile, codec=codec, inputs=inputs, overhead_ms=overhead_ms,
            force=force, progress=lambda msg: bar.update(task, description=msg),
        )  # fmt: skip
    if as_json:
        emit_json(result.to_json())
        return
    _print(result.to_json())


def _print(data: dict[str, Any]) -> None:
    from rich.table import Table

    edge = data["edge"]
    how = (
        f"edge = this machine × {edge['slowdown']:g}"
        if "slowdown" in edge
        else f"edge times from {edge['profile']}"
    )
    table = Table(
        title=f"{data['source']}: cuts at {_rate(data['bandwidth_bps'])} ({how}; "
        f"{data['overhead_ms']:.2f} ms per request)",
        title_justify="left",
    )
    for column in ("cut", "codec", "edge ms", "raw B", "wire B", "link ms", "server ms",
                   "total ms"):  # fmt: skip
        left = column in ("cut", "codec")
        table.add_column(column, justify="left" if left else "right", overflow="fold")
    chosen = data["chosen"]
    for row in data["candidates"]:
        mark = row["cut"] == chosen["cut"] and row["kind"] == chosen["kind"]
        figures = ("edge_ms", "raw_bytes", "wire_bytes", "transfer_ms", "server_ms", "total_ms")
        cells = [_cut(row), row["codec"] + _checked(row["codec_verified"])] + [
            f"{row[k]:,}" if k.endswith("bytes") else f"{row[k]:.2f}" for k in figures
        ]
        table.add_row(*cells, style="bold green" if mark else None)
    console.print(table)
    console.print("codec: ✓ within the accuracy budget end to end, ✗ not, ? not checked",
                  highlight=False, markup=False)  # fmt: skip
    verification = data["verification"] or {}
    console.print(
        f"chose {_cut(chosen)} with codec {chosen['codec']}: predicted {chosen['total_ms']:.2f} ms "
        f"end to end (edge {chosen['edge_ms']:.2f} + link {chosen['transfer_ms']:.2f} + server "
        f"{chosen['server_ms']:.2f}); verified end to end: "
        f"{'ok' if verification.get('ok') else 'FAILED'}",
        highlight=False, markup=False,
    )  # fmt: skip
    if data["output"]:
        server = f" and {data['output']}/server.kiln" if data["server_model"] else ""
        console.print(f"wrote {data['output']}/edge.kiln{server}", highlight=False, markup=False)


def _cut(row: dict[str, Any]) -> str:
    if row["kind"] != "cut":
        return row["kind"]
    tensors = ",".join(row["cut"])
    return tensors if row["after"] == tensors else f"{tensors} (after {row['after']})"


def _checked(verified: bool | None) -> str:
    return {True: " ✓", False: " ✗", None: " ?"}[verified]


def _rate(bits: float) -> str:
    for unit, size in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= size:
            return f"{bits / size:g} {unit}"
    return f"{bits:g} bit/s"
