"""Every full-size zoo model compiles into an fp32-verified artifact (slow: `pytest -m slow`)."""

from __future__ import annotations

import pytest

import kiln
from kiln import zoo

FULL = [n for n in zoo.names() if not zoo.entry(n).tiny]


@pytest.mark.slow
@pytest.mark.parametrize("name", FULL)
def test_full_zoo_model_compiles_verified(name, tmp_path):
    artifact = kiln.compile(f"zoo:{name}", tmp_path / f"{name}.kiln", rounds=0)
    verification = artifact.manifest.verification
    assert verification.ok, verification
    assert artifact.manifest.dropped_passes == []
    assert artifact.manifest.nodes["after"] < artifact.manifest.nodes["before"]
