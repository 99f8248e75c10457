"""Sizes, durations and bandwidths as people write them ("2GiB", "1h30m", "20Mbit/s"), read
into one unit each: bytes, seconds, bits per second. Every flag that takes one reads it here,
so "GB" means the same thing everywhere: decimal prefixes (k, M, G, T) are powers of 1,000,
binary ones (KiB, MiB, GiB, TiB) powers of 1,024. Each parser raises ValueError saying what
it expected; callers add the flag's name."""

from __future__ import annotations

import math
import re

_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"

_SIZES = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip
_SIZE = re.compile(rf"\s*{_NUMBER}\s*([a-zA-Z]*)\s*")

_SECONDS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
_DURATION_PART = re.compile(rf"{_NUMBER}\s*(us|ms|min|s|m|h)?\s*")

_PREFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BANDWIDTH = re.compile(rf"\s*{_NUMBER}\s*([kKmMgGtT]?)(bit|b|B|bps)(/s)?\s*")


def _positive(value: float, text: str, what: str) -> float:
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{text!r}: {what} must be a positive, finite amount")
    return value


def parse_size(text: str, bare_unit: str | None = "B") -> int:
    """'2GiB' → 2147483648, '1.5GB' → 1500000000, '512' → 512: a size in bytes. The unit is
    case-insensitive: B; kB, MB, GB, TB (decimal); KiB, MiB, GiB, TiB (binary). A bare number
    is in `bare_unit` (bytes unless told); with `bare_unit=None` a unit is required."""
    match = _SIZE.fullmatch(text)
    unit = (match.group(2) or bare_unit or "") if match else ""
    if not match or unit.lower() not in _SIZES:
        raise ValueError(
            f"{text!r}: expected a size with its unit (B; kB, MB, GB decimal; KiB, MiB, GiB "
            "binary), e.g. 2GiB"
        )
    size = float(match.group(1)) * _SIZES[unit.lower()]
    return round(_positive(size, text, "a size"))


def parse_duration(text: str, bare_unit: str | None = "s") -> float:
    """'90' → 90.0, '2.5s', '10m', '1h30m' → 5400.0, '20ms' → 0.02: a duration in seconds.
    Units: us, ms, s, m or min, h; parts add up ('1h30m'). A bare number is in `bare_unit`
    (seconds unless told); with `bare_unit=None` a unit is required."""
    parts = list(_DURATION_PART.finditer(text.strip()))
    covered = "".join(part.group(0) for part in parts)
    bare = len(parts) == 1 and parts[0].group(2) is None
    if (not parts or covered != text.strip() or (bare and bare_unit is None)
            or any(part.group(2) is None for part in parts if not bare)):  # fmt: skip
        raise ValueError(
            f"{text!r}: expected a duration with its unit (us, ms, s, m, h), e.g. 90s, 10m or 1h30m"
        )
    seconds = sum(
        float(part.group(1)) * _SECONDS[part.group(2) or bare_unit or "s"] for part in parts
    )
    return _positive(seconds, text, "a duration")


def parse_bandwidth(text: str | float) -> float:
    """'20Mbit/s', '1Gbit/s', '100kbps' → bits per second; '5MB/s' (bytes) → 40e6. Prefixes are
    decimal, as links are sold. A number (int or float) is already bits per second; a string
    needs its unit, since a bare "20" could be bits or bytes."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        return _positive(float(text), str(text), "a bandwidth")
    match = _BANDWIDTH.fullmatch(str(text))
    if not match:
        raise ValueError(f"{text!r}: expected a bandwidth such as 20Mbit/s, 1Gbit/s or 5MB/s")
    bits = float(match[1]) * _PREFIXES[match[2].lower()] * (8.0 if match[3] == "B" else 1.0)
    return _positive(bits, str(text), "a bandwidth")
