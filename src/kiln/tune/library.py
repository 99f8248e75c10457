"""The strategy library: the tuner's memory across models. Each finished study records the
hardware class it ran on, the model's signature, the objective, the winning config, the
Pareto front and the measured gains; the feedback loop records the strategies it adopted or
refused, with their evidence. A new study is warm-started from the nearest models' winners
on the same hardware class only: records never cross hardware classes silently."""

from __future__ import annotations

import datetime as dt
import json
import warnings
from dataclasses import dataclass, fields
from typing import Any

import sqlalchemy as sa

from kiln.errors import KilnError
from kiln.tune.signature import check_signature, distance
from kiln.tune.storage import connect, create_once

METADATA = sa.MetaData()
STRATEGIES = sa.Table(
    "kiln_strategies",
    METADATA,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("created", sa.String(40), nullable=False),
    sa.Column("kind", sa.String(20), nullable=False),  # study | adopted | refused
    sa.Column("hardware_class", sa.String(40), nullable=False, index=True),
    sa.Column("model", sa.String(200), nullable=False),
    sa.Column("objective", sa.String(100), nullable=False),
    sa.Column("body", sa.Text, nullable=False),  # JSON: the rest (see Record)
)

WINDOWS = sa.Table(
    "kiln_feedback_windows",
    METADATA,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("created", sa.String(40), nullable=False),
    sa.Column("hardware_class", sa.String(40), nullable=False),
    sa.Column("model", sa.String(200), nullable=False, index=True),
    sa.Column("body", sa.Text, nullable=False),  # JSON: kiln.tune.feedback.Window
)


@dataclass
class Record:
    kind: str
    hardware: dict[str, Any]  # kiln.tune.signature.hardware()
    model: str
    signature: dict[str, Any]
    objective: str
    params: dict[str, Any]  # the winner's Optuna parameters (what warm starts enqueue)
    config: dict[str, Any]  # the winner's CompileConfig
    gains: dict[str, Any]  # measured against the defaults, with intervals
    pareto: list[dict[str, Any]]
    evidence: dict[str, Any]
    id: int | None = None
    created: str = ""

    def body(self) -> str:
        keys = ("hardware", "signature", "params", "config", "gains", "pareto", "evidence")
        return json.dumps({k: getattr(self, k) for k in keys}, default=str)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "created": self.created, "kind": self.kind, "model": self.model,
            "objective": self.objective, **json.loads(self.body()),
        }  # fmt: skip


class Library:
    """The records on one database (see kiln.tune.storage)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = connect(url)
        create_once(url, lambda: METADATA.create_all(self.engine))

    def add(self, record: Record) -> int:
        """The record's id: a new row; or the row already holding the same record (a re-import
        adds nothing); or, for a study, the row of the same study on this hardware class,
        brought up to date (a rerun or a resumed study is one record, not one per run)."""
        created = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        row = {
            "kind": record.kind, "hardware_class": record.hardware["class"],
            "model": record.model, "objective": record.objective, "body": record.body(),
        }  # fmt: skip
        with self.engine.begin() as connection:
            same = connection.execute(
                sa.select(STRATEGIES.c.id).where(*(STRATEGIES.c[k] == v for k, v in row.items()))
            ).first()
            if same is not None:
                return int(same.id)
            earlier = self._same_study(connection, record)
            if earlier is not None:
                connection.execute(
                    STRATEGIES.update().where(STRATEGIES.c.id == earlier)
                    .values(created=created, **row)
                )  # fmt: skip
                return earlier
            result = connection.execute(STRATEGIES.insert().values(created=created, **row))
            return int(result.inserted_primary_key[0])

    def _same_study(self, connection: Any, record: Record) -> int | None:
        study = record.evidence.get("study") if record.kind == "study" else None
        if not study:
            return None
        query = sa.select(STRATEGIES).where(
            STRATEGIES.c.kind == "study",
            STRATEGIES.c.hardware_class == record.hardware["class"],
            STRATEGIES.c.model == record.model,
            STRATEGIES.c.objective == record.objective,
        )
        for row in connection.execute(query):
            evidence = _json_object(row.body).get("evidence")
            if isinstance(evidence, dict) and evidence.get("study") == study:
                return int(row.id)
        return None

    def add_window(self, model: str, window: dict[str, Any]) -> None:
        """One window of live traffic, as the feedback loop aggregated it."""
        from kiln.tune.signature import hardware

        created = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        with self.engine.begin() as connection:
            connection.execute(
                WINDOWS.insert().values(
                    created=created, hardware_class=hardware()["class"], model=model,
                    body=json.dumps(window, default=str),
                )
            )  # fmt: skip

    def windows(self, model: str) -> list[dict[str, Any]]:
        query = sa.select(WINDOWS).where(WINDOWS.c.model == model).order_by(WINDOWS.c.id)
        with self.engine.connect() as connection:
            return [json.loads(row.body) for row in connection.execute(query)]

    def records(self, hardware_class: str | None = None, kind: str | None = None) -> list[Record]:
        query = sa.select(STRATEGIES).order_by(STRATEGIES.c.id)
        if hardware_class is not None:
            query = query.where(STRATEGIES.c.hardware_class == hardware_class)
        if kind is not None:
            query = query.where(STRATEGIES.c.kind == kind)
        with self.engine.connect() as connection:
            rows = list(connection.execute(query))
        out = []
        for row in rows:  # a damaged row (written by hand, or by an older Kiln) is skipped
            try:
                out.append(_record(row))
            except KilnError as exc:
                warnings.warn(f"{exc} It is skipped; remove it with kiln strategies forget "
                              f"{row.id}.", stacklevel=2)  # fmt: skip
        return out

    def get(self, record_id: int) -> Record:
        with self.engine.connect() as connection:
            row = connection.execute(
                sa.select(STRATEGIES).where(STRATEGIES.c.id == record_id)
            ).first()
        if row is None:
            raise KilnError(f"no strategy record {record_id}; see kiln strategies list.")
        return _record(row)

    def forget(self, record_id: int | None = None, model: str | None = None) -> int:
        """How many records were removed; a record id or a model that names none is refused."""
        query = STRATEGIES.delete()
        if record_id is not None:
            query = query.where(STRATEGIES.c.id == record_id)
        if model is not None:
            query = query.where(STRATEGIES.c.model == model)
        with self.engine.begin() as connection:
            removed = int(connection.execute(query).rowcount)
        if not removed:
            if record_id is not None and model is not None:
                what = f"record {record_id} of model {model}"
            elif record_id is not None:
                what = f"record {record_id}"
            else:
                what = f"record of model {model}"
            raise KilnError(f"no strategy {what}; see kiln strategies list --all.")
        return removed

    def nearest(
        self,
        signature: dict[str, Any],
        hardware_class: str,
        objective: str,
        count: int = 3,
        exclude_model: str | None = None,
    ) -> list[tuple[float, Record]]:
        """The winners of the `count` nearest other models on this hardware class."""
        found = [
            (distance(signature, r.signature), r)
            for r in self.records(hardware_class, kind="study")
            if r.objective == objective and r.model != exclude_model
        ]
        best: dict[str, tuple[float, Record]] = {}
        for d, r in sorted(found, key=lambda x: x[0]):
            best.setdefault(r.model, (d, r))  # one (the nearest, then newest) per model
        return sorted(best.values(), key=lambda x: x[0])[:count]


def _json_object(text: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _record(row: Any) -> Record:
    body = _json_object(row.body)
    item = {"kind": row.kind, "model": row.model, "objective": row.objective, **body}
    record = check_record(item, f"strategy record {row.id}")
    record.id, record.created = row.id, row.created
    return record


KINDS = ("study", "adopted", "refused")
# field → the JSON type it must have
_TYPES: dict[str, type] = {
    "kind": str, "hardware": dict, "model": str, "signature": dict, "objective": str,
    "params": dict, "config": dict, "gains": dict, "pareto": list, "evidence": dict,
}  # fmt: skip


def check_record(item: Any, where: str) -> Record:
    """A Record from exported JSON, every field checked: a record that would break a later
    study (a warm start reads its signature and params) is refused here, naming the field."""
    if not isinstance(item, dict):
        raise KilnError(f"{where}: expected a JSON object, got {type(item).__name__}.")
    names = {f.name for f in fields(Record)}
    unknown = sorted(set(item) - names)
    if unknown:
        raise KilnError(f"{where}: unknown field '{unknown[0]}'.")
    for name, kind in _TYPES.items():
        if name not in item:
            raise KilnError(f"{where}: the field '{name}' is missing.")
        if not isinstance(item[name], kind):
            given = json.dumps(item[name], default=str)[:40]
            raise KilnError(f"{where}: '{name}' must be a JSON {_JSON[kind]}, not {given}.")
    if item["kind"] not in KINDS:
        raise KilnError(f"{where}: 'kind' is '{item['kind']}'; expected one of {', '.join(KINDS)}.")
    if not isinstance(item["hardware"].get("class"), str) or not item["hardware"]["class"]:
        raise KilnError(f"{where}: 'hardware' has no 'class' (the hardware fingerprint).")
    problem = check_signature(item["signature"]) if item["kind"] == "study" else None
    if problem:
        raise KilnError(f"{where}: 'signature' {problem}.")
    speed = item["gains"].get("speedup")
    if speed is not None and not (
        isinstance(speed, dict)
        and all(isinstance(speed.get(k), int | float) for k in ("value", "low", "high"))
    ):
        raise KilnError(f"{where}: 'gains.speedup' must hold numbers value, low and high.")
    return Record(**{k: v for k, v in item.items() if k not in ("id", "created")})


_JSON = {str: "string", dict: "object", list: "list"}
