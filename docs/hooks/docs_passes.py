"""The pass reference, generated from the default pipelines in `kiln.passes`: each pass's
name, stage, the engines its output runs on, its one-line summary, and what its class
docstring guarantees."""

from __future__ import annotations

import inspect

from docs_markdown import inline, paragraphs

ENGINES = ("ort", "openvino")


def passes_reference(level: int = 2) -> str:
    from kiln.passes import default_pipeline

    pipelines = {engine: default_pipeline(engine) for engine in ENGINES}
    out = ["#" * level + " The default pipelines"]
    out.append(
        "In the order they run. A pass named twice runs twice: each round of simplification "
        "exposes what the next can resolve. The engine column says which engines can run the "
        "pass's output; a pipeline for the other engine leaves it out."
    )
    out.append(_table(pipelines))
    out.append("#" * level + " What each pass guarantees")
    out.extend(_guarantees(pipelines, level + 1))
    return "\n\n".join(out)


def _table(pipelines: dict) -> str:
    columns = " | ".join(f"{engine} #" for engine in ENGINES)
    rows = [f"| pass | stage | runs on | {columns} | what it does |"]
    rows.append("| --- | --- | --- | " + " | ".join("---" for _ in ENGINES) + " | --- |")
    order = pipelines[ENGINES[0]] + [
        spec for spec in pipelines[ENGINES[1]] if spec.name not in _names(pipelines[ENGINES[0]])
    ]
    done: set[str] = set()
    for spec in order:
        if spec.name in done:
            continue
        done.add(spec.name)
        where = "any engine" if spec.engines is None else ", ".join(sorted(spec.engines))
        positions = " | ".join(_positions(pipelines[engine], spec.name) for engine in ENGINES)
        rows.append(
            f"| [`{spec.name}`](#{spec.name}) | {spec.stage} | {where} | {positions} | "
            f"{inline(spec.doc)} |"
        )
    return "\n".join(rows)


def _guarantees(pipelines: dict, level: int) -> list[str]:
    out: list[str] = []
    done: set[str] = set()
    first: dict[type, str] = {}  # a pass class → the first pass shown with its docstring
    for spec in [s for engine in ENGINES for s in pipelines[engine]]:
        if spec.name in done:
            continue
        done.add(spec.name)
        cls = type(spec.make())
        out.append("#" * level + f" {spec.name} {{#{spec.name}}}")
        out.append(f"{inline(spec.doc)}\n\n`{cls.__module__}.{cls.__name__}`")
        if cls in first:
            out.append(f"Its guarantee is that of [`{first[cls]}`](#{first[cls]}).")
        elif cls.__doc__:
            first[cls] = spec.name
            out.append(paragraphs(inspect.cleandoc(cls.__doc__)))
    return out


def _names(pipeline: list) -> set[str]:
    return {spec.name for spec in pipeline}


def _positions(pipeline: list, name: str) -> str:
    found = [str(i) for i, spec in enumerate(pipeline, 1) if spec.name == name]
    return ", ".join(found) or "–"
