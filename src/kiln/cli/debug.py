"""`kiln debug`: the interactive debugger in the browser — both graphs side by side, provenance,
overlays, breakpoints, steps and the tensors themselves."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from typing import Annotated, Any

import typer

from kiln.cli.console import InputsOpt, JsonOpt, ShapeOpt, err, progress

SIDE_HELP = "an .onnx file, zoo:NAME, a NAME.kiln artifact, or MODEL@ENGINE:PRECISION"


ModelArg = Annotated[str, typer.Argument(help=f"What to debug: {SIDE_HELP}.")]
AgainstOpt = Annotated[
    str | None,
    typer.Option(
        "--against",
        help=f"Measure errors against this side ({SIDE_HELP}); default: the original.",
    ),
]
PortOpt = Annotated[int, typer.Option(help="TCP port to listen on; 0: any free port.")]
HostOpt = Annotated[str, typer.Option(help="Address to bind; 0.0.0.0 for every interface.")]
OpenBrowserOpt = Annotated[
    bool, typer.Option("--open/--no-open", help="Open the page in a browser when ready.")
]
ProfileRunsOpt = Annotated[
    int, typer.Option(help="Profiled runs for kernel times and findings; 0: no profile.")
]


def debug(
    model: ModelArg, against: AgainstOpt = None, inputs: InputsOpt = None, shape: ShapeOpt = [],  # noqa: B006
    port: PortOpt = 8888, host: HostOpt = "127.0.0.1", open_browser: OpenBrowserOpt = True,
    profile_runs: ProfileRunsOpt = 10, as_json: JsonOpt = False,
) -> None:  # fmt: skip
    """Debug MODEL in the browser: its original and compiled graphs side by side (select a node
    on one side, its counterparts light up on the other), provenance, precision, kernel times
    and findings per node, latency / error / precision overlays, and execution with breakpoints,
    single steps and every intermediate tensor (statistics, histogram, values) beside the same
    tensor on the other side. With a reference, the first divergence is highlighted.

    e.g. kiln debug OUT.kiln, kiln debug model.onnx@ort:int8 --against model.onnx.
    Once it serves it prints the address (with --json: one line {"url", ...}); Ctrl-C stops it."""
    import signal

    from kiln.ir.inputs import parse_shapes
    from kiln.serve.server import bind, http_server, url

    shapes = parse_shapes(shape)
    sock = bind(host, port)  # a port in use is one line before anything loads
    with sock:
        from kiln.debug.app import create_app
        from kiln.debug.session import DebugSession

        with progress() as bar:
            task = bar.add_task(f"loading {model}")
            say = lambda msg: bar.update(task, description=msg)  # noqa: E731
            session = DebugSession(
                model,
                against=against,
                inputs=str(inputs) if inputs is not None else None,
                shapes=shapes,
                profile_runs=max(profile_runs, 0),
                say=say,
            )
            say("comparing layer by layer")
            comparison = session.comparison()
        address = url(host, sock.getsockname()[1])

        def ready() -> None:
            _announce(address, host, sock.getsockname()[1], session, comparison, as_json)
            threading.Thread(target=_profile_quietly, args=(session,), daemon=True).start()
            if open_browser:
                import webbrowser

                webbrowser.open(address)

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _stop)
        server = http_server(create_app(session), on_ready=ready)
        # uvicorn would wait on requests in flight (a profile), cancel them with tracebacks, and
        # on a second Ctrl-C cancel its lifespan task with another: the debugger stops at once.
        server.handle_exit = _stop  # type: ignore[method-assign]  # capture_signals installs it
        server.run(sockets=[sock])
    _stop()


def _stop(*_signal: Any) -> None:
    """Ctrl-C or SIGTERM: say so and end the process here. A profile (measured in the
    background, or asked by the page) may still be running inside the engine, and letting
    Python tear down under it aborts the process (C++ terminate); the session keeps nothing
    worth saving."""
    err.print("stopped.", highlight=False)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _announce(
    address: str, host: str, port: int, session: Any, comparison: dict[str, Any], as_json: bool
) -> None:
    first = comparison.get("first_divergence") if comparison.get("available") else None
    notes = [*session.notes, *comparison.get("notes", [])]
    if as_json:
        line = {"url": address, "host": host, "port": port, "first_divergence": first,
                "notes": notes}  # fmt: skip
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()  # a pipe is block-buffered: the reader waits on this line
        return
    say = lambda text: err.print(text, highlight=False, markup=False, soft_wrap=True)  # noqa: E731
    say(f"debugging {session.main.label} on {address} (Ctrl-C to stop)")
    if comparison.get("available"):
        say(f"first divergence: {first or 'none'} (against {session.reference.label})")
    for note in notes:
        say(f"note: {note}")


def _profile_quietly(session: Any) -> None:
    """Measure the profile before the page asks for it; a failure is the page's to show."""
    with contextlib.suppress(Exception):  # asked again by the page, which shows the error
        session.profile()
