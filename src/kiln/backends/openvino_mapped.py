"""What an OpenVINO compile reads from files Kiln can give back (backends/release.py): the
weight files it memory-maps (`release_mapped`) and the folder of its libraries (`release_code`)."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING

import onnx_ir as ir

from kiln.backends import release  # its SUPPORTED read at each call: tests switch it off

if TYPE_CHECKING:
    from kiln.backends.openvino import OpenVinoOptions


def mapped_files(model: ir.Model | str, options: OpenVinoOptions) -> tuple[str, ...]:
    """The weight files OpenVINO will map and Kiln release (`release_mapped`): a model file's
    external data files; none for an in-memory model (its weights are read, not mapped), for
    weights inside the .onnx file, without `mmap`, or elsewhere than Linux."""
    if not (options.release_mapped and options.mmap and release.SUPPORTED):
        return ()
    if not isinstance(model, str | os.PathLike) or not Path(model).is_file():
        return ()
    stat = Path(model).stat()
    if stat.st_size > _INLINE_WEIGHTS:
        return ()  # its weights are inside: read, not mapped, and not worth parsing it for
    return _external_files(str(Path(model).resolve()), (stat.st_mtime_ns, stat.st_size))


# A .onnx file larger than this holds its weights inside; below it, the graph is parsed to find
# its external data files (bert-base's 160 kB graph: 50-80 ms, once per file version).
_INLINE_WEIGHTS = 64 << 20


@functools.lru_cache(maxsize=32)
def _external_files(path: str, stamp: tuple[int, int]) -> tuple[str, ...]:
    """External data files of the model at `path` (`stamp`: its mtime and size, so that a
    rewritten file is read again)."""
    try:
        graph = ir.load(path).graph
    except Exception:  # an unreadable model is reported by the compile itself
        return ()
    files = {
        str(Path(t.path).resolve())
        for v in graph.initializers.values()
        if isinstance(t := v.const_value, ir.ExternalTensor)
    }
    return tuple(sorted(files))


@functools.cache
def libraries() -> tuple[str, ...]:
    """The folder of OpenVINO's shared libraries (plugins, frontends, TBB): `release_code`."""
    import openvino as ov

    return (str(Path(ov.__file__).resolve().parent),)


def release_state(options: OpenVinoOptions, mapped: tuple[str, ...]) -> str:
    if mapped:
        return f"on ({len(mapped)} mapped file{'s' if len(mapped) > 1 else ''})"
    if options.release_mapped and options.mmap and not release.SUPPORTED:
        return "off (Linux only)"
    return "off" if not (options.release_mapped and options.mmap) else "off (nothing mapped)"
