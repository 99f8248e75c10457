"""A model repository in Triton's layout: `ROOT/NAME/VERSION/`, VERSION a positive integer
folder holding a Kiln artifact (`manifest.json`, the model, provenance) or a plain `model.onnx`;
what `kiln export --triton` writes is served too.

A model's `config.pbtxt` (Triton's ModelConfig, text format) is read with Triton's meaning:
`version_policy` picks the version (latest 1 by default; kiln serve serves one version of a
model, so a policy that picks several is refused), `default_model_filename` names the model file
(model.onnx by default), `max_batch_size` (0: requests are not batched; absent: from the model,
as Triton's auto-complete), `dynamic_batching` (absent: each request runs alone, as Triton's
default scheduler; `max_queue_delay_microseconds`, `preferred_batch_size`), `instance_group`
(its count: batches run side by side), `input`/`output` (names, types and dims checked against
the model) and `platform`/`backend`. A field kiln serve cannot honour is refused: the model is
UNAVAILABLE, its reason naming the field and what to do. Folders whose name is not a positive
integer are ignored, as Triton ignores them, and said once each; so are hidden folders.

The repository is read afresh at each look (`names`, `latest`): a version copied in while the
server runs is what the next load serves.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from google.protobuf import text_format
from google.protobuf.message import Message

from kiln.errors import KilnError
from kiln.serve._proto import message
from kiln.serve.protocol import triton_type

if TYPE_CHECKING:
    from kiln.serve.models import BatchSettings

log = logging.getLogger("uvicorn.error")  # configured by uvicorn, so it reaches the console
# Where `kiln export --triton --runtime kiln` puts the artifact in a version folder.
KILN_RUNTIME_ARTIFACT = "artifact.kiln"
CONFIG_FILE = "config.pbtxt"
DEFAULT_MODEL_FILE = "model.onnx"  # onnxruntime's default_model_filename
# Triton's backends kiln serve runs: an ONNX model (ONNX Runtime; OpenVINO reads ONNX too) and
# Kiln's runtime in the Python backend (what `kiln export --triton --runtime kiln` writes).
_BACKENDS = ("onnxruntime", "openvino", "python")
_PLATFORMS = ("onnxruntime_onnx",)
_KILN_ENGINES = {"onnxruntime": "ort", "openvino": "openvino"}  # Triton's backend → Kiln's
# ModelConfig fields that ask for what kiln serve does not do: (field, what it asks for).
_UNHONOURED = [
    ("sequence_batching", "stateful sequences"),
    ("ensemble_scheduling", "an ensemble of models"),
    ("batch_input", "batch inputs"),
    ("batch_output", "batch outputs"),
    ("model_transaction_policy.decoupled", "decoupled responses"),
    ("dynamic_batching.priority_levels", "request priorities"),
    ("dynamic_batching.default_queue_policy", "queue timeouts"),
    ("dynamic_batching.priority_queue_policy", "queue policies per priority"),
]


@dataclass(frozen=True)
class Version:
    """One version folder of a model in the repository."""

    name: str
    number: int
    path: Path
    config: Any = None  # the model's ModelConfig message, None without a config.pbtxt

    @property
    def version(self) -> str:
        return str(self.number)

    @property
    def backend(self) -> str | None:
        """Kiln's engine for a plain model file whose config names one (Triton runs it there);
        None for an artifact, which runs on the engine it was compiled for."""
        if self.config is None or (Path(self.source) / "manifest.json").is_file():
            return None
        return _KILN_ENGINES.get(self.config.model.backend)

    @property
    def source(self) -> str:
        """What a `kiln.Session` opens: the version folder as an artifact; else the artifact
        `kiln export --triton --runtime kiln` puts beside its model.py; else its model file,
        `default_model_filename` or model.onnx (what a native export, or any Triton ONNX
        model, holds). `default_model_filename` may name an artifact too (model.kiln): a
        Kiln artifact is a folder, not a file."""
        filename = (self.config and self.config.model.default_model_filename) or DEFAULT_MODEL_FILE
        for artifact in (self.path, self.path / KILN_RUNTIME_ARTIFACT, self.path / filename):
            if (artifact / "manifest.json").is_file():
                return str(artifact)
        if self.config is not None and self.config.model.backend == "python":
            raise KilnError(
                f"{self.path}: backend 'python' with no Kiln artifact ({KILN_RUNTIME_ARTIFACT}) "
                "beside its model.py; kiln serve cannot run a Python model: export one with "
                "kiln export --triton --runtime kiln, or serve it with tritonserver"
            )
        if (self.path / filename).is_file():
            return str(self.path / filename)
        raise KilnError(
            f"{self.path}: holds neither a Kiln artifact (manifest.json) nor a {filename}; put "
            "one there (kiln optimize MODEL -o that folder) or remove the folder"
        )


class Repository:
    """The repository at `root`; `say` hears each ignored folder and unread policy once."""

    def __init__(self, root: str | Path, say: Callable[[str], None] | None = None) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise KilnError(
                f"--model-repository {root}: no such directory; give a folder laid out as "
                "Triton's, NAME/VERSION/ holding an artifact or a model.onnx"
            )
        self._say = say or log.warning
        self._said: set[str] = set()

    def names(self) -> list[str]:
        """Every model folder's name, sorted."""
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and _shown(p.name))

    def has(self, name: str) -> bool:
        """Whether `name` is a model folder of the repository (not a path out of it)."""
        plain = _shown(name) and "/" not in name and "\\" not in name
        return plain and (self.root / name).is_dir()

    def latest(self, name: str) -> Version:
        """The highest version of model `name`; KilnError naming what is missing."""
        folder = self.root / name
        if not self.has(name):
            listed = ", ".join(f"'{n}'" for n in self.names()) or "none"
            raise KilnError(
                f"no model '{name}' in the repository {self.root} (its models: {listed})"
            )
        config = read_config(folder)
        versions = self._versions(folder)
        if not versions:
            raise KilnError(
                f"{folder}: no version folder; put the model in {folder}/1/ (an artifact or a "
                "model.onnx), as Triton's layout has it"
            )
        return replace(_chosen(folder, config, versions), config=config)

    def _versions(self, folder: Path) -> list[Version]:
        versions = []
        for path in folder.iterdir():
            if not path.is_dir() or not _shown(path.name):
                continue
            number = _positive(path.name)
            if number is None:
                self._once(
                    str(path),
                    f"{path}: ignored, a version folder is named by a positive integer (1, 2, …)",
                )
                continue
            versions.append(Version(folder.name, number, path))
        return versions

    def _once(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            self._say(message)


def _shown(name: str) -> bool:
    return bool(name) and not name.startswith(".")


def _positive(name: str) -> int | None:
    # ASCII digits only: str.isdigit() also takes '²', which int() refuses.
    if name.isascii() and name.isdigit() and int(name) > 0:
        return int(name)
    return None


@dataclass(frozen=True)
class Config:
    """A model's config.pbtxt: where it is, Triton's ModelConfig message, and its
    max_batch_size where written (None: not written, from the model as Triton's auto-complete;
    proto3 cannot tell a written 0 from an absent one)."""

    path: Path
    model: Any
    max_batch_size: int | None


_MAX_BATCH_LINE = re.compile(r"(?:^|[\s{,;])max_batch_size\s*:\s*(-?\d+)")
_COMMENT = re.compile(r"#[^\n]*")


def read_config(folder: Path) -> Config | None:
    """The model's config.pbtxt; None without one. KilnError naming the file, and the field
    and what to do, for text Triton would not parse and for a field kiln serve cannot honour."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        return None
    text = path.read_text(errors="replace")
    model = message("ModelConfig")()
    try:
        text_format.Parse(text, model)
    except text_format.ParseError as exc:
        raise KilnError(f"{path}: {exc}; write it in Triton's ModelConfig text format") from None
    written = _MAX_BATCH_LINE.search(_COMMENT.sub("", text))
    config = Config(path, model, int(written.group(1)) if written else None)
    _check_fields(folder.name, config)
    return config


def _check_fields(name: str, config: Config) -> None:
    """Refuse what the config asks and kiln serve cannot do, before any engine opens."""
    model, where = config.model, config.path
    if model.name and model.name != name:
        raise KilnError(
            f"{where}: name '{model.name}' differs from its folder '{name}'; Triton requires "
            "them equal: rename one, or leave name out"
        )
    for field, allowed in (("platform", _PLATFORMS), ("backend", _BACKENDS)):
        value = getattr(model, field)
        if value and value not in allowed:
            raise KilnError(
                f"{where}: {field} '{value}': kiln serve runs ONNX models (onnxruntime, "
                "openvino) and Kiln artifacts (python, as kiln export --runtime kiln writes); "
                f"give it a model.onnx and {field}: {_quoted(allowed)}, or serve it with "
                "tritonserver"
            )
    for field, what in _UNHONOURED:
        if _written(model, field):
            raise KilnError(
                f"{where}: {field} asks for {what}, which kiln serve does not do; remove it, "
                "or serve this model with tritonserver"
            )
    if config.max_batch_size is not None and config.max_batch_size < 0:
        raise KilnError(f"{where}: max_batch_size {config.max_batch_size}: give 0 or more")


def _written(message_: Message, dotted: str) -> bool:
    """Whether the field at `dotted` (e.g. "dynamic_batching.priority_levels") is set."""
    head, _, tail = dotted.partition(".")
    value = getattr(message_, head)
    if isinstance(value, Message):
        return message_.HasField(head) and (not tail or _written(value, tail))
    if isinstance(value, str | bytes | bool | int | float):
        return bool(value)
    return len(value) > 0  # repeated or map


def _quoted(values: tuple[str, ...]) -> str:
    return " or ".join(f'"{v}"' for v in values)


def _chosen(folder: Path, config: Config | None, versions: list[Version]) -> Version:
    """The version Triton's `version_policy` picks (latest 1 when none is written); KilnError
    when it picks none, or several: kiln serve serves one version of a model."""
    ordered = sorted(versions, key=lambda v: v.number, reverse=True)
    policy = config.model.version_policy if config is not None else None
    which = policy.WhichOneof("policy_choice") if policy is not None else None
    if which == "all":
        picked, asked = ordered, "all {}"
    elif which == "specific":
        wanted = list(policy.specific.versions)
        picked = [v for v in ordered if v.number in wanted]
        asked = f"specific {{ versions: {wanted} }}"
    else:
        count = policy.latest.num_versions if which == "latest" else 1
        picked, asked = ordered[: max(count, 0)], f"latest {{ num_versions: {count} }}"
    where = f"{folder / CONFIG_FILE}: version_policy {asked}"
    numbers = ", ".join(v.version for v in ordered)
    if not picked:
        raise KilnError(f"{where} picks none of the model's versions ({numbers}); name one of them")
    if len(picked) > 1:
        raise KilnError(
            f"{where} picks versions {', '.join(v.version for v in picked)}; kiln serve serves "
            "one version of a model: write version_policy: { latest: { num_versions: 1 } }, "
            "or serve several versions with tritonserver"
        )
    return picked[0]


def served_settings(
    found: Version,
    base: BatchSettings,
    session: Any,
    batch_axis: bool,
    engine: tuple[str, str, str],
) -> BatchSettings:
    """`base` (kiln serve's flags) with what the model's config.pbtxt sets, for `session` as
    opened (`batch_axis`: every value leads with the batch dim; `engine`: Triton's platform,
    backend and instance kind of what runs); KilnError naming the field where the config asks
    what the model or Kiln cannot do."""
    if found.config is None:
        return base
    model, where = found.config.model, found.config.path
    _check_engine(where, model, engine)
    max_batch = found.config.max_batch_size
    if max_batch is None:  # not written: Triton's auto-complete takes it from the model
        max_batch = base.max_batch if batch_axis else 0
    elif max_batch > 0 and not batch_axis:
        raise KilnError(
            f"{where}: max_batch_size {max_batch}, but not every input and output of the model "
            "leads with a batch dim; write max_batch_size: 0 (dims then give whole shapes)"
        )
    _check_tensors(where, model, session, max_batch > 0)
    dynamic = model.HasField("dynamic_batching")
    preferred = tuple(model.dynamic_batching.preferred_batch_size)
    if dynamic and max_batch == 0:
        raise KilnError(
            f"{where}: dynamic_batching needs max_batch_size > 0 (0: the model takes no batch "
            "dim); write max_batch_size: N, or remove dynamic_batching"
        )
    outside = [size for size in preferred if not 0 < size <= max_batch]
    if outside:
        raise KilnError(
            f"{where}: preferred_batch_size {outside[0]} is outside 1..max_batch_size "
            f"{max_batch}; give sizes within it"
        )
    written = found.config.max_batch_size is not None
    return replace(
        base,
        max_batch=max(max_batch, 1),
        max_delay_ms=model.dynamic_batching.max_queue_delay_microseconds / 1000
        if dynamic else base.max_delay_ms,
        preferred=preferred,
        # Triton batches requests together only with dynamic_batching (or an auto-completed
        # max_batch_size, which turns it on); else each request runs alone.
        combine=dynamic or (not written and max_batch > 0),
        batching=max_batch > 0,
        workers=_instances(where, model, engine[2]),
        shapes=_input_shapes(model, session, max_batch > 0),
        engine=_engine_named(model),
    )  # fmt: skip


def _check_tensors(where: Path, model: Any, session: Any, batched: bool) -> None:
    """Each input and output the config names is the model's, of its type and dims (-1 takes
    any size; with a batch dim, dims leave it out)."""
    for kind, tensors, specs in (
        ("input", model.input, session.inputs),
        ("output", model.output, session.outputs),
    ):
        by_name = {spec["name"]: spec for spec in specs}
        for tensor in tensors:
            spec = by_name.get(tensor.name)
            if spec is None:
                raise KilnError(
                    f"{where}: {kind} '{tensor.name}' is not one of the model's "
                    f"({', '.join(by_name)}); use its names"
                )
            _check_tensor(where, kind, tensor, spec, batched)


def _check_tensor(where: Path, kind: str, tensor: Any, spec: dict, batched: bool) -> None:
    field = tensor.DESCRIPTOR.fields_by_name["data_type"].enum_type
    written = field.values_by_number[tensor.data_type].name
    expected = triton_type(spec["datatype"])
    if tensor.data_type and written != expected:
        raise KilnError(
            f"{where}: {kind} '{tensor.name}' data_type {written}, but the model's is "
            f"{expected}; write data_type: {expected}"
        )
    shape = list(spec["shape"][1:] if batched else spec["shape"])
    dims = list(tensor.dims)
    if tensor.HasField("reshape"):
        # Only the form kiln serve's /config writes: one value per row, dims [1] → shape [].
        if dims != [1] or list(tensor.reshape.shape) or shape:
            raise KilnError(
                f"{where}: {kind} '{tensor.name}' reshape {list(tensor.reshape.shape)}: kiln "
                f"serve takes tensors in the model's own shape; remove reshape, write dims: "
                f"{shape or [1]}"
            )
        return
    pairs = zip(dims, shape, strict=False)  # lengths compared first
    fits = len(dims) == len(shape) and all(-1 in (d, s) or d == s for d, s in pairs)
    if not fits and not (dims == [1] and not shape):
        batch = ", the batch dim left out" if batched else ""
        raise KilnError(
            f"{where}: {kind} '{tensor.name}' dims {dims} do not match the model's {shape} "
            f"(-1: any size{batch}); write dims: {shape or [1]}"
        )


def _check_engine(where: Path, model: Any, engine: tuple[str, str, str]) -> None:
    """The engine the config names is the one that runs (an artifact runs on the engine it
    was compiled for; a Python-backend model on Kiln's runtime, as its model.py would)."""
    platform, backend, _ = engine
    named = model.backend or ("onnxruntime" if model.platform else "")
    if named in ("", "python") or named == backend:
        return
    raise KilnError(
        f"{where}: backend '{named}', but the model's artifact runs on {backend or platform}; "
        f'write backend: "{backend}", or compile the model for {named}'
    )


def _input_shapes(model: Any, session: Any, batched: bool) -> dict[str, list[int]]:
    """Each input's shape as requests must give it: the model's, with the sizes the config
    fixes where the model takes any (a checked config: the dims fit the model's)."""
    shapes = {}
    specs = {spec["name"]: spec for spec in session.inputs}
    for tensor in model.input:
        shape = list(specs[tensor.name]["shape"])
        dims = ([-1] if batched else []) + list(tensor.dims)
        if tensor.HasField("reshape") or len(dims) != len(shape):  # dims [1] for a scalar row
            continue
        shapes[tensor.name] = [s if s >= 0 else d for s, d in zip(shape, dims, strict=True)]
    return shapes


def _instances(where: Path, model: Any, kind: str) -> int:
    """How many batches run side by side: the instance groups' counts (1 each by default)."""
    count = 0
    for group in model.instance_group:
        asked = group.DESCRIPTOR.fields_by_name["kind"].enum_type.values_by_number[group.kind]
        if asked.name == "KIND_GPU" and kind != "KIND_GPU":
            raise KilnError(
                f"{where}: instance_group kind KIND_GPU, but the model runs on the CPU here; "
                "write kind: KIND_CPU, or serve it where a GPU engine is installed"
            )
        count += group.count or 1
    return max(count, 1)


def _engine_named(model: Any) -> tuple[str, str] | None:
    """The (platform, backend) the config names, as Triton reports them, where it names the
    Python backend: kiln serve runs its Kiln artifact as that model.py would. Others are the
    engine's own (what runs is what is reported)."""
    return ("", "python") if model.backend == "python" else None
