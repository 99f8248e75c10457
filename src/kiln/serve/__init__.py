"""`kiln serve`: KServe v2 / Open Inference Protocol over HTTP and gRPC, with dynamic batching
and Prometheus metrics, for one model or several, each on its own `kiln.Session`.

Modules, one idea each: `protocol` (JSON and binary tensors), `metrics` (Prometheus and Triton's
statistics), `repository` (a Triton-layout model repository on disk), `models` (the models
served, each with its session and batcher; load, reload and unload while serving), `service`
(what both protocols answer alike: an inference request's path, metadata, repository checks),
`app` (the FastAPI endpoints; `create_app(session, name)` for one model, `create_models_app(models)`
for a `ModelSet`), `grpc_service` (Triton's GRPCInferenceService on the same `ModelSet`, its
messages built in `_proto` from Triton's protos), `server` (the listening socket and uvicorn
around the app), `config` (`ServeConfig`, every setting of one server) and `serving`
(`run(config)`: all of it started, served until a signal). The batcher is
`kiln.runtime.batcher`; the verb is `kiln.cli.serve`. Nothing is imported here, so
`kiln --help` does not pay for FastAPI or gRPC.
"""
