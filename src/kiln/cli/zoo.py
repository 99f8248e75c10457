"""`kiln zoo`: list, describe and export the built-in model architectures."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kiln.cli.console import JsonOpt, check_output, console, emit_json
from kiln.errors import KilnError

app = typer.Typer(help="Built-in model architectures (seeded weights, authored in code).")


@app.command("list")
def zoo_list(as_json: JsonOpt = False) -> None:
    """List the built-in models."""
    from kiln import zoo
    from kiln.report.terminal import print_zoo_list

    entries = [zoo.entry(n) for n in zoo.names()]
    listed = [{"name": e.name, "description": e.description, "tiny": e.tiny} for e in entries]
    if as_json:
        emit_json(listed)
    else:
        print_zoo_list(listed, console)


@app.command("info")
def zoo_info(name: str, as_json: JsonOpt = False) -> None:
    """Show a zoo model's inputs, outputs, size, FLOPs and bytes against the published figure."""
    import numpy as np

    from kiln import zoo
    from kiln.cost import node_costs, total_cost, unknown_ops
    from kiln.report.terminal import print_zoo_info

    e = zoo.entry(name)
    model = zoo.build(name)
    costs = node_costs(model, e.dims)
    total = total_cost(costs.values())
    gflops = total.flops / 1e9  # every op counted
    mac_gflops = 2 * total.macs / 1e9  # what published figures count: 2 × MACs
    params = sum(int(np.prod(t.dims)) for t in model.graph.initializer)
    info = {
        "name": e.name,
        "description": e.description,
        "dims": e.dims,
        "parameters": params,
        "nodes": len(model.graph.node),
        "opset": next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
        "gflops": gflops,
        "mac_gflops": mac_gflops,
        "gbytes": total.bytes / 1e9,
        "intensity": total.intensity,
        "unknown_ops": unknown_ops(costs),
        "published_gflops": e.published_gflops,
        "published_source": e.published_source,
        # like with like: 2×MAC GFLOPs against the published 2×MACs
        "deviation": (mac_gflops / e.published_gflops - 1) if e.published_gflops else None,
        "deviation_basis": "2×MAC GFLOPs vs published 2×MACs",
        "inputs": [_value_info(v) for v in model.graph.input],
        "outputs": [_value_info(v) for v in model.graph.output],
    }
    if as_json:
        emit_json(info)
    else:
        print_zoo_info(info, console)


def _value_info(v) -> str:
    import onnx

    dims = [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
    return f"{v.name}: {onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type)}{dims}"


@app.command("export")
def zoo_export(
    name: str,
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the .onnx file.")],
    as_json: JsonOpt = False,
) -> None:
    """Write a zoo model to an ONNX file (external data beside it when large)."""
    import onnx

    from kiln import zoo
    from kiln.home import atomic_write_bytes

    zoo.entry(name)  # an unknown name fails first, naming the known ones
    check_output(output)  # before building the model: a bad -o costs nothing
    model = zoo.build(name)
    data = output.name + ".data" if model.ByteSize() > (1 << 30) else None
    try:
        if data:  # large weights go beside it (protobuf caps one file at 2 GiB)
            onnx.save(model, str(output), save_as_external_data=True, location=data)
        else:
            atomic_write_bytes(output, model.SerializeToString())
    except OSError as exc:
        raise KilnError(
            f"-o {output}: could not write the model ({exc.strerror or exc})."
        ) from None
    if as_json:
        emit_json(
            {
                "name": name,
                "output": str(output),
                "bytes": output.stat().st_size,
                "external_data": str(output.with_name(data)) if data else None,
            }
        )
    else:
        console.print(f"wrote {output}", highlight=False, markup=False)
