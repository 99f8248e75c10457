"""The debugger's web app: the page and its assets (all in the package: it works offline) and
a JSON API over one `DebugSession`.

    GET  /                          the page (web/index.html; web/app.js, web/style.css)
    GET  /api/session               what is debugged against what, the inputs, notes
    GET  /api/graphs                both graphs (nodes in topological order, provenance)
    GET  /api/compare               the layer-wise comparison and each pane's per-node error
    GET  /api/profile               kernels, per-node ms, the timeline, diagnosis findings
    GET  /api/node?pane=&name=      one node: provenance, precision, error, kernels, findings
    GET  /api/exec                  where execution stands
    POST /api/exec/{action}         step | run | continue | reset
    POST /api/breakpoints           {"node": NAME, "on": true|false}
    GET  /api/tensor?name=&side=&index=   statistics, histogram, a slice (side: main|against)
    GET  /api/tensor.npy?name=&side=      the raw array (.npy)
    POST /api/inputs/seed           {"seed": N}: synthesized inputs from another seed
    POST /api/inputs                an .npz body: replaces the inputs it names
    PUT  /api/inputs/{name}         an .npy body: replaces that input

An error the user can cause is a 400 with {"detail": one line}; JSON carries no NaN (see
`tensors.number`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fastapi import Body, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles

from kiln.debug.session import DebugSession
from kiln.debug.tensors import read_arrays
from kiln.errors import KilnError

WEB = Path(__file__).parent / "web"


def jsonable(value: Any) -> Any:
    """numpy scalars as Python numbers; NaN and infinities as text."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # a numpy scalar
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _scalar(value: Any) -> Any:
    if hasattr(value, "item"):  # a numpy scalar
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON")


class _Json(JSONResponse):
    def render(self, content: Any) -> bytes:
        try:  # the common case, fast: plain data with no NaN (a graph of 1,000 nodes: 30 ms)
            text = json.dumps(content, allow_nan=False, separators=(",", ":"), default=_scalar)
        except ValueError:  # a NaN or an infinity somewhere: walk it all
            text = json.dumps(jsonable(content), allow_nan=False, separators=(",", ":"))
        return text.encode()


def create_app(session: DebugSession) -> FastAPI:
    """The app around `session` (serve it with uvicorn)."""
    app = FastAPI(title="kiln debug", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.session = session
    app.mount("/static", StaticFiles(directory=WEB), name="static")

    @app.exception_handler(KilnError)
    async def _refused(_request: Request, exc: KilnError) -> Response:
        return _Json({"detail": " ".join(str(exc).splitlines())}, status_code=400)

    @app.get("/", include_in_schema=False)
    def page() -> FileResponse:
        return FileResponse(WEB / "index.html", media_type="text/html")

    @app.get("/api/session")
    def summary() -> Response:
        return _Json(session.summary())

    @app.get("/api/graphs")
    def graphs() -> Response:
        return _Json(session.graphs())

    @app.get("/api/compare")
    def comparison() -> Response:
        return _Json(session.comparison())

    @app.get("/api/profile")
    def profile() -> Response:
        return _Json(session.profile())

    @app.get("/api/node")
    def node(pane: str, name: str) -> Response:
        return _Json(session.node(pane, name))

    @app.get("/api/exec")
    def state() -> Response:
        return _Json(session.stepper.to_json())

    @app.post("/api/exec/{action}")
    def execute(action: str) -> Response:
        return _Json(session.execute(action))

    @app.post("/api/breakpoints")
    def breakpoint_(node: str = Body(...), on: bool = Body(True)) -> Response:
        return _Json(session.set_breakpoint(node, on))

    @app.get("/api/tensor")
    def tensor(name: str, side: str = "main", index: str | None = None) -> Response:
        return _Json(session.tensor(name, side, index))

    @app.get("/api/tensor.npy")
    def tensor_npy(name: str, side: str = "main") -> Response:
        return Response(session.tensor_npy(name, side), media_type="application/octet-stream")

    @app.post("/api/inputs/seed")
    def reseed(seed: int = Body(..., embed=True)) -> Response:
        return _Json(session.reseed(seed))

    @app.post("/api/inputs")
    async def upload(request: Request) -> Response:
        arrays = read_arrays(await request.body())
        return _Json(session.set_inputs(arrays))

    @app.put("/api/inputs/{name}")
    async def replace(name: str, request: Request) -> Response:
        arrays = read_arrays(await request.body(), name)
        return _Json(session.set_inputs(arrays))

    return app
