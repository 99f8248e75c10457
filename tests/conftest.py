"""Shared fixtures: keep Kiln's state out of the user's home during tests."""

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def kiln_home(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.mktemp("kiln-home")
    monkeypatch.setenv("KILN_HOME", str(home))
    return home


@pytest.fixture(scope="module")
def module_home(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[Path]:
    """KILN_HOME for a module's module-scoped servers, which outlive the per-test one above:
    a directory of their own, set while the module's fixtures are set up."""
    path = tmp_path_factory.mktemp(f"{request.module.__name__}-home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KILN_HOME", str(path))
        yield path
