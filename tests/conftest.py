"""Shared fixtures: keep Kiln's state out of the user's home during tests."""

import pytest


@pytest.fixture(autouse=True)
def kiln_home(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.mktemp("kiln-home")
    monkeypatch.setenv("KILN_HOME", str(home))
    return home
