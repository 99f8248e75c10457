"""Writing what was chosen: a single-part artifact as any compile writes it, or a partitioned
one — each part an ordinary artifact under parts/, beside the piece of the original it was
built from, and one manifest and provenance for the whole."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx_ir as ir

from kiln.artifact import BackendInfo, PassRecord, SourceInfo, new_manifest, provenance_map
from kiln.artifact.manifest import PARTS_BACKEND
from kiln.artifact.parts import PARTS_DIR
from kiln.artifact.store import Artifact, write_partitioned
from kiln.compiler.candidate import CompileResult
from kiln.errors import KilnError
from kiln.ir.inputs import default_dims
from kiln.ir.load import fingerprint
from kiln.partition.build import PartitionedBuild, pipeline_precision
from kiln.partition.choose import PARTITIONED
from kiln.passes.simplify import count_nodes

# kiln.compiler.api.save_result, handed in by its caller (the api imports this package)
Save = Callable[..., Artifact]


def save_chosen(
    chosen: PartitionedBuild | CompileResult,
    destination: Path,
    bench: dict | None,
    save: Save,
    force: bool = False,
) -> Artifact:
    """Write what `build_partitioned` chose with `save` (`kiln.compiler.save_result`): a
    single-part artifact as any compile writes it, or a partitioned one whose parts are each
    such an artifact. Nothing is written when verification failed."""
    if isinstance(chosen, CompileResult):
        return save(chosen, destination, bench, force=force)
    if not chosen.ok:
        summary = chosen.verification.summary() if chosen.verification else ""
        raise KilnError(
            f"{chosen.loaded.source}: the partitioned pipeline does not match the original "
            f"({summary}). Nothing was written; use --partition none."
        )
    return _write(chosen, Path(destination), bench, save, force)


def _write(
    built: PartitionedBuild, destination: Path, bench: dict | None, save: Save, force: bool
) -> Artifact:
    section = built.section
    if not section.placement:
        section.placement = {
            "choice": PARTITIONED,
            "placement": ",".join(f"{p.name}={p.engine}" for p in section.parts),
            "threads": {p.name: p.threads for p in section.parts},
            "why": "placement given",
        }
    final = destination.absolute()

    def fill(tmp: Path) -> None:
        (tmp / PARTS_DIR).mkdir()
        for spec in section.parts:
            ir.save(built.pieces[spec.name], tmp / spec.piece)
            result = built.results[spec.name]
            source = str(final / spec.piece)  # the part's original: kiln compare finds it
            part = dataclasses.replace(result, loaded=dataclasses.replace(
                result.loaded, source=source, fingerprint=fingerprint(built.pieces[spec.name])
            ))  # fmt: skip
            save(part, tmp / spec.path)

    manifest = _manifest(built, bench)
    return write_partitioned(destination, manifest, _provenance(built), fill, force)


def _manifest(built: PartitionedBuild, bench: dict | None) -> Any:
    from kiln.artifact.manifest import source_path

    loaded, results = built.loaded, built.results
    passes: Counter[str] = Counter()
    created: Counter[str] = Counter()
    for result in results.values():
        for report in result.reports:
            passes[report.name] += report.rewrites
            created[report.name] += report.nodes_created
    manifest = new_manifest(
        source=SourceInfo(loaded.name, source_path(loaded.source), loaded.fingerprint),
        model=loaded.model,
        config=built.config,
        backend=BackendInfo(PARTS_BACKEND, {}),
        passes=[PassRecord(name, passes[name], created[name]) for name in passes],
        dropped_passes=[f"{p}: {d}" for p, r in results.items() for d in r.dropped],
        nodes={
            "before": count_nodes(loaded.model),
            "after": sum(count_nodes(r.model) for r in results.values()),
        },  # fmt: skip
        precision={"default": pipeline_precision(built.section.parts), "nodes": {}},
        dims=default_dims(loaded.model),
        verification=built.verification,
        benchmark=bench,
        notes=[f"part {p}: {n}" for p, r in results.items() for n in r.notes],
    )
    manifest.parts = built.section.to_json()
    return manifest


def _provenance(built: PartitionedBuild) -> dict[str, dict[str, Any]]:
    """Each part's compiled nodes (as `PART/NODE`) → the original nodes and passes."""
    out = {}
    for name, result in built.results.items():
        for node, entry in provenance_map(result.model).items():
            out[f"{name}/{node}"] = {**entry, "part": name}
    return out
