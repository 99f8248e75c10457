"""A wheel of the Kiln running the export, for the image that serves its artifacts with
Kiln's runtime: built from the installed `kiln` package's own files, so the image runs the
Kiln that wrote and measured the export whether it was installed from a wheel or from a
checkout. Kiln is pure Python: the wheel is tagged py3-none-any.

    wheel_file() → "kiln_ml-0.1.0-py3-none-any.whl"; build_wheel() → its bytes

The image installs it with `--no-deps`, beside the packages Kiln's runtime imports
(kserve.image_requirements): the distribution's own dependencies (the CLI's, the tuner's,
the server's) are not needed to serve an artifact in Triton.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as metadata
import io
import zipfile
from pathlib import Path

from kiln import __version__

DISTRIBUTION = "kiln-ml"
# What Kiln's runtime imports to serve an artifact, beside numpy and the engine's package: the
# wheel's companions in an image, and in the tests' Triton environment (local_triton).
RUNTIME_PACKAGES = ("onnxruntime", "onnx", "onnx-ir", "onnxscript", "psutil")
_STEM = f"kiln_ml-{__version__}"  # the distribution name as wheel file names spell it
WHEEL_GLOB = "kiln_ml-*.whl"  # an earlier export's wheel, of whatever version
# Fixed timestamps: the same Kiln gives the same bytes, so an image layer is reused.
_EPOCH = (1980, 1, 1, 0, 0, 0)
_PACKAGE = Path(__file__).resolve().parents[1]  # the `kiln` package this module is part of


def wheel_file() -> str:
    return f"{_STEM}-py3-none-any.whl"


def build_wheel() -> bytes:
    """The wheel's bytes: the package's files (no bytecode), METADATA, WHEEL, the entry
    points and the RECORD of them all."""
    files = {
        f"kiln/{path.relative_to(_PACKAGE).as_posix()}": path.read_bytes()
        for path in sorted(_PACKAGE.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }
    info = f"{_STEM}.dist-info"
    minimal = f"Metadata-Version: 2.1\nName: {DISTRIBUTION}\nVersion: {__version__}\n"
    files[f"{info}/METADATA"] = (_installed("METADATA") or minimal).encode()
    files[f"{info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: kiln export\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    entry_points = _installed("entry_points.txt")  # the `kiln` command
    if entry_points:
        files[f"{info}/entry_points.txt"] = entry_points.encode()
    files[f"{info}/RECORD"] = _record(files, f"{info}/RECORD").encode()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as wheel:
        for name, data in files.items():
            entry = zipfile.ZipInfo(name, date_time=_EPOCH)
            entry.external_attr = 0o644 << 16
            wheel.writestr(entry, data, zipfile.ZIP_DEFLATED)
    return out.getvalue()


def _installed(name: str) -> str | None:
    """A file of the installed distribution's metadata where that is this Kiln's; None where
    Kiln was imported from a source tree that was never installed."""
    try:
        installed = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None
    return installed.read_text(name) if installed.version == __version__ else None


def _record(files: dict[str, bytes], record: str) -> str:
    """RECORD: each file with its sha256 (urlsafe base64, unpadded) and size; itself bare."""
    lines = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        lines.append(f"{name},sha256={digest},{len(data)}")
    return "\n".join([*lines, f"{record},,"]) + "\n"
