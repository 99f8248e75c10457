"""Sizes, durations and bandwidths read one way for every flag (kiln.units)."""

from __future__ import annotations

import pytest

from kiln.units import parse_bandwidth, parse_duration, parse_size


@pytest.mark.parametrize(
    "text, size",
    [("512", 512), ("512B", 512), ("1kB", 1000), ("1KB", 1000), ("100MB", 10**8),
     ("1.5GB", 15 * 10**8), ("2GiB", 2 * 2**30), ("1KiB", 1024), ("3 mib", 3 * 2**20),
     ("1TB", 10**12)],
)  # fmt: skip
def test_sizes_decimal_and_binary(text, size):
    assert parse_size(text) == size


def test_a_bare_size_takes_the_callers_unit_or_is_refused():
    assert parse_size("2", bare_unit="MiB") == 2 * 2**20
    with pytest.raises(ValueError, match="unit"):
        parse_size("2", bare_unit=None)


@pytest.mark.parametrize("text", ["", "lots", "0GB", "-1MB", "2 apples", "1.5.3GB", "GB"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(ValueError, match=repr(text).replace(".", r"\.")):
        parse_size(text)


@pytest.mark.parametrize(
    "text, seconds",
    [("90", 90.0), ("2.5s", 2.5), ("10m", 600.0), ("10min", 600.0), ("1h", 3600.0),
     ("1h30m", 5400.0), ("1h 30m 5s", 5405.0), ("20ms", 0.02), ("1us", 1e-6)],
)  # fmt: skip
def test_durations(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


def test_a_bare_duration_takes_the_callers_unit_or_is_refused():
    assert parse_duration("20", bare_unit="ms") == pytest.approx(0.02)
    with pytest.raises(ValueError, match="unit"):
        parse_duration("20", bare_unit=None)


@pytest.mark.parametrize("text", ["", "soon", "0s", "1h30", "10 apples", "-5s", "1.5.3"])
def test_bad_durations_are_refused(text):
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    "text, bits",
    [("20Mbit/s", 20e6), ("1Gbit/s", 1e9), ("5MB/s", 40e6), ("100kbps", 1e5),
     ("10 Mb/s", 10e6), (2.5e6, 2.5e6), (100, 100.0)],
)  # fmt: skip
def test_bandwidths(text, bits):
    assert parse_bandwidth(text) == pytest.approx(bits)


@pytest.mark.parametrize("text", ["20", "fast", "0Mbit/s", "-1Mbit/s", 0, float("inf")])
def test_bad_bandwidths_are_refused(text):
    with pytest.raises(ValueError, match="bandwidth"):
        parse_bandwidth(text)
