"""The strategy library as `kiln strategies` and every study read it: records checked in
full on import, a damaged record skipped (never fatal to a later study), no duplicates on a
rerun or a re-import, and the verbs' errors one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import kiln
from kiln.tune.library import STRATEGIES, Library, Record, check_record
from kiln.tune.signature import hardware
from kiln.tune.storage import default_url

SIGNATURE = {"ops": {"Conv": 1.0}, "nodes": 10, "flops": {"conv": 1, "matmul": 0},
             "parameters": 1, "dynamic_dims": []}  # fmt: skip


def record(model="conv-net", study="s1", **changes) -> Record:
    made = Record("study", hardware(), model, SIGNATURE, "latency", {"engine": "ort"}, {}, {},
                  [], {"study": study, "trials": 1})  # fmt: skip
    for key, value in changes.items():
        setattr(made, key, value)
    return made


def strategies(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln", "strategies", *args], input=stdin,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


@pytest.mark.parametrize(
    "signature, message",
    [("x", "'signature' must be a JSON object"), ({}, "'signature' needs 'ops'"),
     ({"ops": "x"}, "'signature' needs 'ops'"),
     ({**SIGNATURE, "flops": {"conv": "big"}}, "'signature' needs 'flops'")],
)  # fmt: skip
def test_a_record_a_warm_start_could_not_read_is_refused(signature, message):
    with pytest.raises(kiln.KilnError, match=f"record 1: {message}"):
        check_record(record().to_json() | {"signature": signature}, "record 1")


def test_import_checks_every_record_before_adding_any(tmp_path):
    item = record().to_json() | {"signature": {"ops": "x"}}
    (tmp_path / "bad.json").write_text(json.dumps([record(model="good").to_json(), item]))
    outcome = strategies("import", str(tmp_path / "bad.json"))
    assert outcome.returncode == 2, outcome.stderr
    lines = outcome.stderr.strip().splitlines()
    assert len(lines) == 1 and "record 1: 'signature' needs 'ops'" in lines[0], outcome.stderr
    assert Library(default_url()).records() == []  # nothing half-imported


def test_import_errors_say_what_is_wrong_without_python_internals():
    with pytest.raises(kiln.KilnError, match="unknown field 'colour'"):
        check_record(record().to_json() | {"colour": "red"}, "r")
    with pytest.raises(kiln.KilnError, match="the field 'params' is missing"):
        check_record({k: v for k, v in record().to_json().items() if k != "params"}, "r")


def test_a_damaged_stored_record_is_skipped_with_a_warning_not_fatal():
    library = Library(default_url())
    good = library.add(record())
    with library.engine.begin() as connection:  # as an older Kiln or a hand edit left it
        connection.execute(STRATEGIES.insert().values(
            created="", kind="study", hardware_class=hardware()["class"], model="broken",
            objective="latency", body=json.dumps({"signature": {"ops": "x"}}),
        ))  # fmt: skip
    with pytest.warns(UserWarning, match="strategy record 2: .* It is skipped"):
        found = library.nearest(SIGNATURE, hardware()["class"], "latency")
    assert [r.id for _d, r in found] == [good]


def test_reruns_and_reimports_add_no_duplicates(tmp_path):
    library = Library(default_url())
    first = library.add(record())
    assert library.add(record(gains={"verdict": "better"})) == first  # the same study, rerun
    assert library.add(record(study="s2")) != first  # another study is another record
    exported = [r.to_json() for r in library.records()]
    (tmp_path / "e.json").write_text(json.dumps(exported))
    outcome = strategies("import", str(tmp_path / "e.json"), "--json")
    assert outcome.returncode == 0, outcome.stderr
    assert json.loads(outcome.stdout)["imported"] == 0
    assert len(library.records()) == 2


def test_forget_of_a_missing_record_is_an_error_and_export_writes_to_stdout():
    Library(default_url()).add(record())
    outcome = strategies("forget", "999")
    assert outcome.returncode == 2 and "no strategy record 999" in outcome.stderr
    outcome = strategies("export", "-o", "-")
    assert outcome.returncode == 0, outcome.stderr
    assert [r["model"] for r in json.loads(outcome.stdout)] == ["conv-net"]
    imported = strategies("import", "-", "--storage", f"sqlite:///{default_url()[10:]}2",
                          stdin=outcome.stdout)  # fmt: skip
    assert imported.returncode == 0 and "imported 1 records" in imported.stdout
