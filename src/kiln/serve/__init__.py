"""`kiln serve`: KServe v2 / Open Inference Protocol over HTTP, with dynamic batching and
Prometheus metrics, on top of one `kiln.Session`.

Modules, one idea each: `protocol` (JSON and binary tensors), `batcher` (dynamic batching),
`metrics` (Prometheus), `app` (the FastAPI endpoints; `create_app(session, name)`), `server`
(the listening socket and uvicorn around the app). The verb is `kiln.cli.serve`. Nothing is
imported here, so `kiln --help` does not pay for FastAPI.
"""
