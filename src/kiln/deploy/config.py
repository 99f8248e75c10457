"""The Triton ModelConfig of an artifact: what Kiln decided, in the fields and parameters
Triton's backends document.

The shape of the config (inputs and outputs with dims, max_batch_size, dynamic_batching,
instance_group) is `kiln serve`'s own `/config` answer (kiln.serve.protocol.model_config), so
a model reads the same on both servers. The engine settings go where each backend's README
says it reads them:

- onnxruntime_backend: `optimization { graph { level } }` (-1 basic, 1 extended, 2 disabled;
  absent: all, its default) and the parameters `intra_op_thread_count`,
  `inter_op_thread_count`, `execution_mode` (0 sequential, 1 parallel), `enable_mem_arena`,
  `enable_mem_pattern`.
- openvino_backend: the parameters `PERFORMANCE_HINT`, `NUM_STREAMS`, `INFERENCE_NUM_THREADS`,
  `HINT_BF16`, `TARGET_DEVICE`, and `default_model_filename: "model.onnx"` (it reads ONNX
  itself; its default file is OpenVINO IR's model.xml).

A setting those backends have no parameter for is not invented: it is named in the notes.
"""

from __future__ import annotations

import importlib.metadata as metadata
from typing import Any

import onnx_ir as ir

from kiln.artifact import Artifact, Manifest
from kiln.artifact.parts import PartsSection
from kiln.hardware import cpu_info
from kiln.runtime.metadata import graph_inputs, kserve_meta, node_arg
from kiln.runtime.padding import batch_dims, input_layout
from kiln.runtime.parts import interface_of
from kiln.serve.protocol import model_config

# Kiln's runtime in Triton's Python backend, or the artifact's engine as a Triton backend.
KILN = "kiln"
NATIVE = "native"
RUNTIMES = (NATIVE, KILN)
# kiln serve's batcher when `kiln tune --clients` chose none: up to 16, no delay.
DEFAULT_MAX_BATCH = 16
# Kiln's engine → Triton's (platform, backend). OpenVINO has no platform name in Triton.
_TRITON_ENGINES = {"ort": ("onnxruntime_onnx", "onnxruntime"), "openvino": ("", "openvino")}
# OrtOptions.optimization → onnxruntime_backend's graph level ("all" is its default).
_ORT_LEVELS = {"basic": -1, "extended": 1, "disable": 2}
# Kiln's engine → its option of a session's threads (0: the engine's default).
_THREADS = {"ort": "intra_op_threads", "openvino": "inference_num_threads"}
# Kiln's engine → the pip distribution that runs and verifies it here (CPU builds).
ENGINE_DISTRIBUTIONS = {"ort": "onnxruntime", "openvino": "openvino"}
# The newest ONNX IR version ONNX Runtime 1.15 reads (its error says so: "max supported IR
# version: 9"): the runtime of tritonserver:23.05, KServe's kserve-tritonserver image.
_TRITON_23_05_MAX_IR = 9
WARMUP = "kiln_warmup"


def triton_backend(manifest: Manifest, runtime: str) -> str:
    """The Triton backend that serves the artifact: its engine's, or Python for Kiln's."""
    return "python" if runtime == KILN else _TRITON_ENGINES[manifest.backend.name][1]


def triton_config(
    artifact: Artifact, name: str, runtime: str
) -> tuple[dict[str, Any], list[str], str]:
    """Triton's ModelConfig JSON for serving `artifact` as model `name`, notes (what Kiln
    decided that the config cannot say), and for a native backend what its engine must
    read (`engine_requirement`; "" for Kiln's runtime, which runs the artifact's own)."""
    manifest = artifact.manifest
    model = interface(artifact)
    inputs = [kserve_meta(v) for v in graph_inputs(model)]
    outputs = [kserve_meta(v) for v in model.graph.outputs]
    max_batch, delay_ms = tuned_batcher(manifest)
    engine = manifest.backend.name
    platform, backend = ("", "python") if runtime == KILN else _TRITON_ENGINES[engine]
    config = model_config(
        name, inputs, outputs, platform=platform, backend=backend, kind="KIND_CPU",
        max_batch_size=max_batch if has_batch_axis(model) else 0, max_delay_s=delay_ms / 1000,
    )  # fmt: skip
    notes: list[str] = []
    requires = ""
    if runtime == NATIVE:
        threads, _ = engine_threads(manifest)
        config.update(_ENGINE_SETTINGS[engine](manifest.backend.options, threads, notes))
        requires = engine_requirement(model, engine)
    warmup = warmup_of(model, manifest, config, notes)
    if warmup:
        config["model_warmup"] = [warmup]
    return config, notes, requires


def engine_threads(manifest: Manifest) -> tuple[int, str]:
    """(threads, where the number comes from): the engine threads the artifact's settings
    give one session, the CPUs one replica asks for. 0 leaves them to the engine, which
    runs one per physical core: this machine's, as Kiln sees them. A native config names
    the same number, so the engine in a pod runs the threads its cpu limit pays for, not
    one per core of whatever node it lands on."""
    if manifest.parts:  # the cores its parts were given: independent ones run at once
        return sum(p.threads for p in PartsSection.from_json(manifest.parts).parts), "parts"
    threads = int(manifest.backend.options.get(_THREADS.get(manifest.backend.name, ""), 0))
    if threads > 0:
        return threads, "artifact"
    return cpu_info().physical_cores, "physical cores"


def engine_requirement(model: ir.Model, engine: str) -> str:
    """What the Triton backend's engine must read, in a sentence: model.onnx's IR version
    and opsets, and the engine version that runs and verifies it here. An older ONNX
    Runtime refuses a newer IR version or opset, and Triton's images pin their own."""
    opsets = ", ".join(f"{domain or 'ai.onnx'} {version}"
                       for domain, version in sorted(model.opset_imports.items()))  # fmt: skip
    distribution = ENGINE_DISTRIBUTIONS[engine]
    text = (f"model.onnx is ONNX IR version {model.ir_version}, opsets {opsets}; Kiln runs "
            f"and verifies it with {distribution} {metadata.version(distribution)}: the "
            f"backend's {distribution} must read that IR version and those opsets")  # fmt: skip
    if engine == "ort" and (model.ir_version or 0) > _TRITON_23_05_MAX_IR:
        text += (f" (ONNX Runtime 1.15, in tritonserver:23.05, reads IR version "
                 f"{_TRITON_23_05_MAX_IR} at most)")  # fmt: skip
    return text


def interface(artifact: Artifact) -> ir.Model:
    """The model requests are checked against: its graph (external weights stay on disk), or
    for a partitioned artifact the whole's inputs and outputs as its manifest records them
    (what kiln.Session checks a request against there)."""
    if artifact.manifest.parts:
        return interface_of(artifact.manifest)
    return ir.load(artifact.model_path)


def tuned_batcher(manifest: Manifest) -> tuple[int, float]:
    """(max batch, max delay ms): what `kiln tune --clients` measured best for this artifact
    (its manifest's tune → serving), else kiln serve's defaults: 16, no delay."""
    tuned = ((manifest.benchmark or {}).get("tune") or {}).get("serving") or {}
    return int(tuned.get("max_batch", DEFAULT_MAX_BATCH)), float(tuned.get("max_delay_ms", 0.0))


def has_batch_axis(model: ir.Model) -> bool:
    """Whether every input and output leads with the model's batch dim: what Triton's
    max_batch_size > 0 says of a model (as kiln serve decides it)."""
    batch = batch_dims(input_layout(model))
    values = [*graph_inputs(model), *model.graph.outputs]
    return bool(batch) and all(node_arg(v).shape[:1] and node_arg(v).shape[0] in batch
                               for v in values)  # fmt: skip


# ---------------------------------------------------------------- engine settings


def _ort_settings(options: dict[str, Any], threads: int, notes: list[str]) -> dict[str, Any]:
    config: dict[str, Any] = {}
    level = _ORT_LEVELS.get(options.get("optimization", "all"))
    if level is not None:
        config["optimization"] = {"graph": {"level": level}}
    mode = 1 if options.get("execution_mode") == "parallel" else 0
    config["parameters"] = _parameters({
        # engine_threads: never 0, which in a pod is one thread per core of the node.
        "intra_op_thread_count": threads,
        "inter_op_thread_count": int(options.get("inter_op_threads", 0)),
        "execution_mode": mode,
        "enable_mem_arena": int(bool(options.get("memory_arena", True))),
        "enable_mem_pattern": int(bool(options.get("memory_pattern", True))),
    })  # fmt: skip
    if not options.get("spinning", True):
        notes.append(
            "ONNX Runtime's spinning is off in the artifact (session.intra_op.allow_spinning=0); "
            "the onnxruntime backend has no parameter for it, so Triton's sessions spin"
        )
    for name in options.get("disabled_optimizers") or []:
        notes.append(
            f"ONNX Runtime's {name} optimizer is off in the artifact (measured slower here); "
            "the onnxruntime backend has no parameter for it, so Triton's sessions run it"
        )
    _note_extra(options, notes, "onnxruntime")
    return config


def _openvino_settings(options: dict[str, Any], threads: int, notes: list[str]) -> dict[str, Any]:
    parameters: dict[str, Any] = {"PERFORMANCE_HINT": options.get("performance_hint", "LATENCY")}
    if int(options.get("num_streams", 0)) > 0:
        parameters["NUM_STREAMS"] = int(options["num_streams"])
    # engine_threads: never left to OpenVINO, which in a pod counts the node's cores.
    parameters["INFERENCE_NUM_THREADS"] = threads
    precision = options.get("inference_precision")
    if precision == "bf16":
        parameters["HINT_BF16"] = "YES"
    elif precision == "f32":
        notes.append(
            "the artifact was verified at OpenVINO precision f32; the openvino backend has no "
            "f32 hint, and on CPUs with bf16 (AMX, AVX512_BF16) OpenVINO runs bf16 by default: "
            "use --runtime kiln to keep f32"
        )
    device = options.get("device", "CPU")
    if device != "CPU":
        parameters["TARGET_DEVICE"] = device
    if options.get("cache_dir"):
        notes.append("OpenVINO's model cache (cache_dir) is not carried: Triton has no parameter")
    _note_extra(options, notes, "openvino")
    return {"default_model_filename": "model.onnx", "parameters": _parameters(parameters)}


def _note_extra(options: dict[str, Any], notes: list[str], backend: str) -> None:
    for key, value in (options.get("extra") or {}).items():
        notes.append(f"engine option {key}={value} is not carried: the {backend} backend "
                     "does not document it")  # fmt: skip
    if options.get("dim_overrides"):
        notes.append("the artifact's fixed dims (dim_overrides) are not carried: Triton runs "
                     "the model's own shapes")  # fmt: skip


def _parameters(values: dict[str, Any]) -> dict[str, Any]:
    """Triton's `parameters` map: every value a string."""
    return {key: {"string_value": str(value)} for key, value in values.items()}


_ENGINE_SETTINGS = {"ort": _ort_settings, "openvino": _openvino_settings}


# ---------------------------------------------------------------- warm-up


def warmup_of(
    model: ir.Model, manifest: Manifest, config: dict[str, Any], notes: list[str]
) -> dict[str, Any] | None:
    """One warm-up request of zeros at the shapes Kiln verified the artifact on (the
    manifest's dims), so Triton runs the model once before it reports ready. None, with a
    note, where a shape cannot be known or an input holds text."""
    batched = config["max_batch_size"] > 0
    inputs = {}
    for value, spec in zip(graph_inputs(model), config["input"], strict=True):
        shape = node_arg(value).shape[1:] if batched else node_arg(value).shape
        dims = [manifest.dims.get(d) if isinstance(d, str) else d for d in shape]
        if spec["data_type"] == "TYPE_STRING" or any(d is None for d in dims):
            why = "holds text" if spec["data_type"] == "TYPE_STRING" else "has a dim of no size"
            notes.append(f"no model_warmup: input '{spec['name']}' {why}")
            return None
        inputs[spec["name"]] = {"data_type": spec["data_type"], "dims": dims or [1],
                                "zero_data": True}  # fmt: skip
    return {"name": WARMUP, "batch_size": 1, "inputs": inputs}
