"""The strategy library: the tuner's memory across models. Each finished study records the
hardware class it ran on, the model's signature, the objective, the winning config, the
Pareto front and the measured gains; the feedback loop records the strategies it adopted or
refused, with their evidence. A new study is warm-started from the nearest models' winners
on the same hardware class only: records never cross hardware classes silently."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from kiln.errors import KilnError
from kiln.tune.signature import distance
from kiln.tune.storage import connect

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
        METADATA.create_all(self.engine)

    def add(self, record: Record) -> int:
        created = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        with self.engine.begin() as connection:
            result = connection.execute(
                STRATEGIES.insert().values(
                    created=created, kind=record.kind,
                    hardware_class=record.hardware["class"], model=record.model,
                    objective=record.objective, body=record.body(),
                )
            )  # fmt: skip
            return int(result.inserted_primary_key[0])

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
            return [_record(row) for row in connection.execute(query)]

    def get(self, record_id: int) -> Record:
        with self.engine.connect() as connection:
            row = connection.execute(
                sa.select(STRATEGIES).where(STRATEGIES.c.id == record_id)
            ).first()
        if row is None:
            raise KilnError(f"no strategy record {record_id}; see kiln strategies list.")
        return _record(row)

    def forget(self, record_id: int | None = None, model: str | None = None) -> int:
        query = STRATEGIES.delete()
        if record_id is not None:
            query = query.where(STRATEGIES.c.id == record_id)
        if model is not None:
            query = query.where(STRATEGIES.c.model == model)
        with self.engine.begin() as connection:
            return int(connection.execute(query).rowcount)

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


def _record(row: Any) -> Record:
    body = json.loads(row.body)
    return Record(
        kind=row.kind, model=row.model, objective=row.objective, id=row.id, created=row.created,
        hardware=body["hardware"], signature=body["signature"], params=body["params"],
        config=body["config"], gains=body["gains"], pareto=body["pareto"],
        evidence=body["evidence"],
    )  # fmt: skip
