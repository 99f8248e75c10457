"""The docs build's hook (mkdocs.yml `hooks:`): the reference pages generated from the code,
the benchmark pages in the nav as they appear, and fresh screenshots.

A page asks for generated content with a marker on a line of its own, `<!-- kiln:NAME -->`,
NAME one of GENERATORS; the build replaces it, and the line under it that tells a reader of
the raw file (on GitHub) where else to look (RAW_NOTE...). A generator that fails fails the
build.
"""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docs_api
import docs_cli
import docs_config
import docs_layers
import docs_passes
import docs_screenshots
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.kiln")
GENERATORS: dict[str, Callable[[], str]] = {
    "cli": docs_cli.cli_reference,
    "config": docs_config.config_reference,
    "passes": docs_passes.passes_reference,
    "api": docs_api.api_reference,
    "layers": docs_layers.layers_list,
}
RAW_NOTE = "*Generated when the documentation site is built"
_MARKER = re.compile(rf"^<!-- kiln:([\w-]+) -->$(?:\n{re.escape(RAW_NOTE)}.*$)?", re.MULTILINE)
BENCHMARKS = "Benchmarks"
_generated: dict[str, str] = {}  # per build: each generator runs once
_shots_dir: Path | None = None


def on_config(config: Any) -> Any:
    """Every docs/benchmarks/*.md not named in the nav is appended to its Benchmarks section,
    in name order: the benchmark pages are generated from results, one per suite."""
    _generated.clear()
    docs = Path(config["docs_dir"])
    for section in config["nav"] or []:
        if isinstance(section, dict) and BENCHMARKS in section:
            listed = {_page_of(item) for item in section[BENCHMARKS]}
            for page in sorted((docs / "benchmarks").glob("*.md")):
                path = page.relative_to(docs).as_posix()
                if path not in listed:
                    section[BENCHMARKS].append(path)
    return config


def _page_of(item: Any) -> str | None:
    if isinstance(item, str):
        return item
    if isinstance(item, dict) and len(item) == 1:
        value = next(iter(item.values()))
        return value if isinstance(value, str) else None
    return None


def on_files(files: Files, config: Any) -> Files:
    """The screenshots, taken now, into the built site (they are not kept in git)."""
    global _shots_dir
    if _shots_dir is None:
        _shots_dir = Path(tempfile.mkdtemp(prefix="kiln-docs-shots-"))
        try:
            docs_screenshots.take(_shots_dir)
        except Exception as exc:
            raise PluginError(f"the docs' screenshots failed: {exc}") from exc
    for path in docs_screenshots.SHOTS.values():
        fresh = _shots_dir / path
        if fresh.is_file():
            files.append(File.generated(config, path, abs_src_path=str(fresh)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    return _MARKER.sub(lambda found: _generate(found[1], page.file.src_uri), markdown)


def _generate(name: str, where: str) -> str:
    if name not in GENERATORS:
        raise PluginError(f"{where}: no generator '{name}'; there are {', '.join(GENERATORS)}")
    if name not in _generated:
        try:
            _generated[name] = GENERATORS[name]()
        except Exception as exc:
            raise PluginError(f"{where}: generating '{name}' failed: {exc}") from exc
    return _generated[name]


def on_shutdown() -> None:
    if _shots_dir is not None:
        shutil.rmtree(_shots_dir, ignore_errors=True)
