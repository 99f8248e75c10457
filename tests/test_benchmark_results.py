"""Benchmark results as data: every committed result file fits the one schema, and the pages and
the README table rendered from them are what `benchmarks/render.py` would write."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
RESULTS = sorted((BENCHMARKS / "results").glob("*/*.json"))
if str(BENCHMARKS) not in sys.path:  # as when a benchmark runs: its directory comes first
    sys.path.insert(0, str(BENCHMARKS))

import _results  # noqa: E402
import render  # noqa: E402

from kiln.hardware.cpu import class_of  # noqa: E402


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_committed_result_fits_the_schema(path: Path) -> None:
    document = json.loads(path.read_text())
    assert _results.validate(document) == []
    assert path.parent.name == document["suite"]
    # filed under its date, CPU class and commit
    prefix = f"{document['date']}-{document['machine']['cpu_class']}-{document['kiln']['commit']}"
    assert path.name.startswith(prefix)


def test_the_schema_refuses_a_row_without_a_unit_and_a_bad_spread() -> None:
    document = json.loads(RESULTS[0].read_text())
    document["rows"] = [{"label": "x", "value": 1.0, "spread": [1.0]}]
    problems = _results.validate(document)
    assert any("unit" in p for p in problems) and any("spread" in p for p in problems)


@pytest.mark.parametrize(
    ("model", "features", "expected"),
    [
        ("AMD EPYC 9R14", ["avx2", "avx512f", "avx512_vnni", "avx512_bf16"], "amd-epyc-avx512bf16"),
        ("Intel(R) Xeon(R) Platinum 8488C", ["avx512_bf16", "amx_tile"], "intel-xeon-amx"),
        (
            "Intel(R) Xeon(R) Platinum 8375C",
            ["avx2", "avx512f", "avx512_vnni"],
            "intel-xeon-avx512vnni",
        ),
        ("AMD EPYC 7R32", ["avx2", "fma"], "amd-epyc-avx2"),
    ],
)
def test_results_are_filed_under_the_cpu_family_and_its_widest_matrix_isa(
    model: str, features: list[str], expected: str
) -> None:
    assert class_of(model, features) == expected


def test_check_passes_on_the_repository(capsys: pytest.CaptureFixture[str]) -> None:
    assert render.main(["--check"]) == 0, capsys.readouterr().err


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """The results, the scripts' docstrings, docs/benchmarks and a README with the table's
    markers, rendered once: a repository where --check passes."""
    shutil.copytree(BENCHMARKS, tmp_path / "benchmarks", ignore=shutil.ignore_patterns("__py*"))
    readme = (ROOT / "README.md").read_text()
    if render.START not in readme:
        readme += f"\n## What to expect\n\n{render.START}\n{render.END}\n"
    (tmp_path / "README.md").write_text(readme)
    assert render.main(["--root", str(tmp_path)]) == 0
    assert render.main(["--check", "--root", str(tmp_path)]) == 0
    return tmp_path


def _edit_first_figure(path: Path) -> None:
    """Change the first table row's figure by hand, as someone pasting a number would."""
    lines = path.read_text().splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if render.START in line), 0)
    index = next(
        i for i, line in enumerate(lines) if i > start and line.startswith("| ") and "×" in line
    )
    lines[index] = lines[index].replace("×", "0×", 1)
    path.write_text("".join(lines))


@pytest.mark.parametrize("page", ["docs/benchmarks/index.md", "README.md", "suite"])
def test_a_hand_edited_table_fails_the_check_naming_the_file(
    copy: Path, page: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if page == "suite":
        page = f"docs/benchmarks/{RESULTS[0].parent.name}.md"
    assert "×" in (copy / page).read_text(), f"{page} shows no figure to edit"
    _edit_first_figure(copy / page)
    capsys.readouterr()
    assert render.main(["--check", "--root", str(copy)]) == 1
    assert page in capsys.readouterr().err


def test_the_readme_table_has_every_expectation_each_linked_to_its_result(copy: Path) -> None:
    readme = (copy / "README.md").read_text()
    table = readme[readme.index(render.START) : readme.index(render.END)]
    for item in render.expectations(render.load_results(copy)):
        row = f"| {item['cpu_class']} | {item['model']} | {item['precision']} |"
        assert row in table, f"{row} is not in the README's table"
        assert f"]({item['path']})" in table
        assert (copy / item["path"]).is_file()
