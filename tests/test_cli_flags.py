"""A verb's flags are generated from its record's fields (kiln.cli.flags): the CLI and the
Python API cannot disagree on a default, and a verb stays flags → record → one call."""

from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from kiln.cli import app
from kiln.cli.flags import FIELD, Options

CLI = Path(__file__).parents[1] / "src" / "kiln" / "cli"


def _generated() -> list[tuple[str, str, Options, str]]:
    """(verb, group parameter, its options, field path) for every generated flag."""
    rows = []
    for info in app.registered_commands:
        for group, spec in getattr(info.callback, "options", {}).items():
            name = info.name or info.callback.__name__
            rows += [(name, group, spec, path) for path in spec.flags]
    return rows


def _params(verb: str) -> dict:
    return {p.name: p for p in get_command(app).commands[verb].params}


def test_every_record_verb_generates_its_flags() -> None:
    verbs = {verb for verb, *_ in _generated()}
    assert {"optimize", "serve", "train", "tune", "bench"} <= verbs


@pytest.mark.parametrize(("verb", "group", "spec", "path"), _generated(),
                         ids=lambda v: v if isinstance(v, str) else "")  # fmt: skip
def test_a_flags_default_is_its_records_default(verb, group, spec, path) -> None:
    param = _params(verb)[f"{group}__{path.replace('.', '__')}"]
    flag = spec.flags[path]
    if spec.override:  # laid over a base record: unset unless given, the default named
        assert param.default is None
        assert param.help.endswith(f"else {_shown(spec.default(path))}.")
        return
    default = param.default if flag.default is FIELD else flag.default
    if flag.default is not FIELD:  # a flag of another type: its default parses to the field's
        assert flag.parse is not None
        default = flag.parse(default)
    assert default == spec.default(path)


def _shown(value: object) -> str:
    return "none" if value is None else str(value)


def test_a_flags_help_is_its_fields_docstring() -> None:
    help_ = _params("optimize")["config__max_drop"].help
    assert help_ == "How far the metric may fall below fp32's, relative (0.01 = 1 %)."


def test_the_feedback_loop_defaults_are_the_loops_own() -> None:
    from kiln.serve.config import ServeConfig
    from kiln.tune.feedback import FeedbackLoop

    loop = inspect.signature(FeedbackLoop.__init__).parameters
    config = ServeConfig(models=("m.kiln",))
    assert config.feedback_interval == loop["interval_s"].default
    assert config.min_gain == loop["min_gain"].default
    assert config.feedback_objective == loop["objective"].default


def test_the_tune_defaults_are_plan_fors() -> None:
    from kiln.tune.plan import TuneConfig
    from kiln.tune.study import plan_for

    plan = inspect.signature(plan_for).parameters
    config = TuneConfig()
    assert config.seconds_per_trial == plan["seconds_per_trial"].default
    assert config.confirm_runs == plan["confirm_runs"].default
    assert config.stale_after == plan["stale_after_s"].default
    assert config.clients == plan["clients"].default


def test_checkpointing_help_names_every_policy() -> None:
    from kiln.train.config import CHECKPOINTING

    help_ = _params("train")["changes__checkpointing__policy"].help
    assert all(policy in help_ for policy in CHECKPOINTING), help_


@pytest.mark.parametrize("verb", ["train", "optimize", "serve", "tune", "bench"])
def test_every_option_name_is_whole_at_80_columns(verb: str) -> None:
    done = CliRunner().invoke(app, [verb, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert done.exit_code == 0, done.output
    words = set(done.output.replace("│", " ").split())
    for param in get_command(app).commands[verb].params:
        for name in [*param.opts, *param.secondary_opts]:
            if name.startswith("-"):
                assert name in words, f"{name} is not shown whole:\n{done.output}"


def _verb_functions() -> list[tuple[str, ast.FunctionDef]]:
    names = {info.callback.__name__ for info in app.registered_commands}
    found = []
    for path in sorted(CLI.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name in names:
                found.append((f"{path.name}:{node.name}", node))
    return found


def test_a_verb_is_at_most_60_lines_signature_included() -> None:
    long = {where: node.end_lineno - node.lineno + 1 for where, node in _verb_functions()
            if node.end_lineno - node.lineno + 1 > 60}  # fmt: skip
    assert not long


def test_strategies_show_honours_json(tmp_path) -> None:
    from kiln.tune.library import Library, Record

    url = f"sqlite:///{tmp_path / 'library.db'}"
    signature = {"ops": {"Conv": 1.0}, "flops": {"conv": 1.0, "matmul": 0.0}, "parameters": 10}
    record = Record(kind="study", hardware={"class": "cpu"}, model="m", signature=signature,
                    objective="latency", params={}, config={"engine": "ort"}, gains={},
                    pareto=[], evidence={})  # fmt: skip
    record_id = Library(url).add(record)
    runner = CliRunner()
    shown = runner.invoke(app, ["strategies", "show", str(record_id), "--storage", url, "--json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["config"] == {"engine": "ort"}
    table = runner.invoke(app, ["strategies", "show", str(record_id), "--storage", url],
                          env={"COLUMNS": "120"}, terminal_width=120)  # fmt: skip
    assert table.exit_code == 0, table.output
    assert "objective" in table.output and "latency" in table.output
    with pytest.raises(json.JSONDecodeError):
        json.loads(table.output)


# The names users and docs rely on: a generated option keeps its flag's name.
FLAG_NAMES = {
    "optimize": (
        "--backend --block-size --calib --calib-method --config --force --inputs --json "
        "--max-drop --max-memory --memory --metric --no-memory --no-verify --output "
        "--partition --precision --rounds --runs --shape --show-pipeline --skip-pass --static "
        "-o"
    ),
    "serve": (
        "--adaptive --buckets --feedback --feedback-interval --feedback-objective --grpc-port "
        "--host --json --max-batch --max-delay-ms --max-queue --max-request-mb --min-gain "
        "--model-repository --name --no-adaptive --no-feedback --no-warmup --port --storage "
        "--warmup"
    ),
    "train": (
        "--accumulation --allow-config-change --batch --checkpoint --checkpoint-every "
        "--checkpointing --clip-grad-norm --config --data --early-stop --epochs --export "
        "--json --loss --lr-schedule --max-memory --metrics --nnodes --nproc --optimizer "
        "--output --precision --profile --progress-every --rdzv-endpoint --resume --save "
        "--steps --storage --strategy --study --target-loss --time --trials --tune "
        "--val-every --warmup -o"
    ),
    "tune": (
        "--backend --calib --clients --confirm-runs --inputs --json --max-drop --max-jitter "
        "--max-memory --max-p50 --max-p99 --metric --min-throughput --no-warm-start "
        "--objective --output --precision --report --seconds-per-trial --seed --shape "
        "--stale-after --storage --study --time --traffic --trials --warm-start --workers -o"
    ),
    "bench": (
        "--against --batch --calib --inputs --json --memory --no-memory --output --rounds "
        "--runs --shape -o"
    ),
}


@pytest.mark.parametrize("verb", sorted(FLAG_NAMES))
def test_every_flag_name_users_have_stays(verb: str) -> None:
    shown = {o for p in _params(verb).values() for o in [*p.opts, *p.secondary_opts]}
    assert set(FLAG_NAMES[verb].split()) <= shown
