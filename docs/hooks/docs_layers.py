"""The layers of `kiln`, read from the import-linter layers contract in pyproject.toml: the
architecture page lists them as `lint-imports` enforces them."""

from __future__ import annotations

from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def layers_list() -> str:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    contracts = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]
    layered = [c for c in contracts if c.get("type") == "layers"]
    if not layered:
        raise ValueError(f"{PYPROJECT}: no import-linter layers contract")
    rows = []
    for index, layer in enumerate(layered[0]["layers"], 1):
        names = [name.strip() for name in layer.split("|")]
        rows.append(f"{index}. " + ", ".join(f"`{name}`" for name in names))
    return "\n".join(rows)
