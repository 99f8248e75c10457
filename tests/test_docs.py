"""The documentation cannot rot: the site builds with `mkdocs build --strict` (a broken link or
reference fails), its generated reference covers every verb and config field, and the code
blocks of the quickstart and the how-to pages run.

A page's ```bash blocks run with `bash -e` in a fresh directory, its ```python blocks in one
interpreter, all in page order; a block preceded on the line before its fence by
`<!-- skip-test -->` is left out, and a page holding `<!-- test: slow -->` runs under
`-m slow`. Without MkDocs (a test dependency) the build test fails."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TEST_PEAKS

from kiln.hardware.peaks import cache_path, save_peaks

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SKIP = "<!-- skip-test -->"
SLOW = "<!-- test: slow -->"
RUNNABLE = ("bash", "python")
PAGE_TIMEOUT_S = 540  # under pytest-timeout's 600, so that the page's processes are stopped
_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)\s*$")


def _require_mkdocs() -> None:
    if importlib.util.find_spec("mkdocs") is None:  # a test dependency: never skipped
        pytest.fail("MkDocs is missing: pip install -e '.[test]' brings it")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    _require_mkdocs()
    out = tmp_path_factory.mktemp("site")
    # Built before any test's own KILN_HOME exists: a home of its own, peaks cached (the
    # screenshots' `kiln profile` would otherwise measure them).
    home = tmp_path_factory.mktemp("docs-home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KILN_HOME", str(home))
        save_peaks(cache_path(), TEST_PEAKS)
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
        cwd=ROOT, env={**os.environ, "KILN_HOME": str(home), "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-6000:]
    return out


def test_site_builds_strict_with_every_page(site):
    nav = re.findall(r"[\w/.-]+\.md", (ROOT / "mkdocs.yml").read_text())
    for page in nav:
        built = site / (page.removesuffix(".md").removesuffix("index") + "/index.html")
        built = site / "index.html" if page == "index.md" else built
        assert built.is_file(), f"{page} was not built"


RAW_NOTE = "*Generated when the documentation site is built"
_MARKER = re.compile(r"^<!-- kiln:[\w-]+ -->$", re.MULTILINE)


def test_a_generated_page_tells_a_reader_of_the_raw_file_where_to_look():
    """On GitHub a marker reads as nothing: the line under it says where the text is."""
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        for found in _MARKER.finditer(text):
            below = text[found.end() + 1 :].split("\n", 1)[0]
            assert below.startswith(RAW_NOTE), f"{page.relative_to(ROOT)}: {below!r}"


def test_the_site_drops_the_raw_readers_note(site):
    for page in sorted(DOCS.rglob("*.md")):
        if _MARKER.search(page.read_text()):
            built = site / page.relative_to(DOCS).with_suffix("") / "index.html"
            assert "Generated when the documentation" not in built.read_text(), built


def test_cli_reference_has_every_verb_and_flag(site):
    import typer

    from kiln.cli import app

    html = (site / "reference/cli/index.html").read_text()
    root = typer.main.get_command(app)
    for path, command in _verbs(root, root.context_class(root, info_name="kiln"), "kiln"):
        anchor = f'id="{path.replace(" ", "-")}"'
        assert anchor in html, f"{path} is not in the CLI reference"
        section = html[html.index(anchor) :]
        section = section[: section.find('id="kiln-', len(anchor))]  # up to the next verb
        for param in command.params:
            for flag in param.opts if param.name != "help" else ():
                if flag.startswith("-"):
                    assert f"{flag}" in section, f"{path} {flag} is not in the CLI reference"


def _verbs(group, context, path: str):
    """(path, command) for every verb under `group`, sub-verbs included."""
    for name in group.list_commands(context):
        command = group.get_command(context, name)
        yield f"{path} {name}", command
        if hasattr(command, "list_commands"):
            inner = command.context_class(command, info_name=name, parent=context)
            yield from _verbs(command, inner, f"{path} {name}")


def test_config_reference_has_every_field(site):
    from kiln.config import CompileConfig, TimingConfig
    from kiln.serve.config import ServeConfig
    from kiln.train.config import TrainConfig
    from kiln.tune.plan import TuneConfig

    html = (site / "reference/config/index.html").read_text()
    for record in (CompileConfig, TimingConfig, TuneConfig, ServeConfig, TrainConfig):
        for field in dataclasses.fields(record):
            assert f"<code>{field.name}</code>" in html, f"{record.__name__}.{field.name}"


def test_pass_reference_has_every_pass(site):
    from kiln.passes import default_pipeline

    html = (site / "reference/passes/index.html").read_text()
    for engine in ("ort", "openvino"):
        for spec in default_pipeline(engine):
            assert f'id="{spec.name}"' in html, f"pass {spec.name} is not in the reference"


# ---------------------------------------------------------------- the pages' code blocks


@dataclasses.dataclass(frozen=True)
class Block:
    lang: str
    line: int  # of its opening fence, 1-based
    code: str


def code_blocks(text: str) -> list[Block]:
    """The page's ```bash and ```python blocks, in order, less those marked SKIP."""
    lines = text.splitlines()
    blocks, index = [], 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if opening is None or not opening["lang"]:
            index += 1
            continue
        indent, end = opening["indent"], index + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        body = "\n".join(line.removeprefix(indent) for line in lines[index + 1 : end])
        skipped = index > 0 and lines[index - 1].strip() == SKIP
        if opening["lang"] in RUNNABLE and not skipped:
            blocks.append(Block(opening["lang"], index + 1, body + "\n"))
        index = end + 1
    return blocks


def _pages() -> list:
    pages = [DOCS / "getting-started" / "quickstart.md", *sorted((DOCS / "how-to").glob("*.md"))]
    params = []
    for page in pages:
        if not page.is_file() or not code_blocks(page.read_text()):
            continue
        marks = [pytest.mark.slow] if SLOW in page.read_text() else []
        params.append(pytest.param(page, id=page.relative_to(DOCS).as_posix(), marks=marks))
    return params


# Runs the blocks in order in one interpreter: python blocks share one namespace, bash blocks
# run with `bash -e` in the same directory. Stops at the first failure, naming its line.
_DRIVER = """
import json, subprocess, sys, traceback
page, blocks = sys.argv[1], json.load(open(sys.argv[2]))
namespace = {"__name__": "__main__"}
for block in blocks:
    where = f"{page}:{block['line']} ({block['lang']})"
    print(f"--- {where}", flush=True)
    if block["lang"] == "bash":
        code = subprocess.run(["bash", "-e", "-c", block["code"]]).returncode
        if code:
            sys.exit(f"{where} exited {code}")
        continue
    try:
        exec(compile(block["code"], where, "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        sys.exit(f"{where} raised")
"""


@pytest.mark.parametrize("page", _pages())
def test_page_code_blocks_run(page: Path, tmp_path: Path) -> None:
    blocks = [dataclasses.asdict(b) for b in code_blocks(page.read_text())]
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    (tmp_path / "driver.py").write_text(_DRIVER)
    work = tmp_path / "work"
    work.mkdir()
    venv_bin = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"}
    relative = page.relative_to(DOCS).as_posix()
    driver = [sys.executable, str(tmp_path / "driver.py"), relative, str(tmp_path / "blocks.json")]
    # A session of its own: a server a block starts in the background, or one left in the
    # foreground past the deadline, is stopped with everything else the page started.
    proc = subprocess.Popen(
        driver, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=PAGE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate()
        pytest.fail(
            f"{relative}: its blocks ran past {PAGE_TIMEOUT_S} s (a server in the foreground? "
            f"mark its block {SKIP}, or start it in the background)\n{out[-3000:]}"
        )
    finally:
        _stop_group(proc.pid)
    assert proc.returncode == 0, f"{out[-3000:]}\n{err[-3000:]}"


def _stop_group(group: int) -> None:
    """SIGTERM to every process of the page's session, then SIGKILL to what is left."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def test_code_blocks_are_found_and_skipped_as_marked() -> None:
    text = "\n".join([
        "```bash", "kiln zoo list", "```",
        SKIP, "```bash", "kiln serve x.kiln", "```",
        "```python", "import kiln", "```",
        "```text", "not run", "```",
        "- a list item:", "", "    ```python", "    x = 1", "    ```",
    ])  # fmt: skip
    assert code_blocks(text) == [
        Block("bash", 1, "kiln zoo list\n"),
        Block("python", 8, "import kiln\n"),
        Block("python", 16, "x = 1\n"),
    ]
