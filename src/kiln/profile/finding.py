"""A finding: one bottleneck, how much it costs, the evidence, and the change that addresses
it. `kiln profile` (kiln.profile.diagnose), `kiln train --profile` (kiln.train.profiling) and
the debugger's panes all speak of bottlenecks in this one record, so the reports and the
debugger show either kind alike."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class Finding:
    """A bottleneck. `share` is of the time measured (a memory finding's: of the peak
    memory); `action` is the fix, said as the command or settings that apply it.

    Where a finding comes from fills the rest: `nodes` are the slowest kernels concerned
    (kiln profile); `settings` the config fields to try, dotted ({"loader.workers": 1}) and
    `measured` the advice timed against the settings in use (kiln train)."""

    kind: str
    title: str
    share: float
    time_ms: float | None  # per run or step; None where the finding is not about time
    evidence: str
    action: str
    nodes: list[str] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    # kiln.timing.Speedup's JSON with "tried": true, or {"tried": false, "why": ...}; None
    # where nothing was timed
    measured: dict[str, Any] | None = None

    def changes(self) -> dict[str, Any]:
        """`settings` nested by section, {"loader": {"workers": 1}, "precision": "bf16"}: the
        form TrainConfig.replace(**...) and a train.json take."""
        return nested(self.settings)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "changes": self.changes()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Finding:
        """The record `to_json` wrote (keys it does not know, such as "changes", ignored)."""
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})


def nested(settings: dict[str, Any]) -> dict[str, Any]:
    """Dotted settings nested by section: {"loader.workers": 1} → {"loader": {"workers": 1}}."""
    out: dict[str, Any] = {}
    for key, value in settings.items():
        section, _, name = key.rpartition(".")
        (out.setdefault(section, {}) if section else out)[name] = value
    return out
