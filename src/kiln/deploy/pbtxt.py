"""Triton's ModelConfig as the text a `config.pbtxt` holds.

With tritonclient installed the text comes from Triton's own schema (its `model_config_pb2`):
the config is parsed into a ModelConfig message, which refuses an unknown field or a wrong
type, and printed by protobuf's text format, so Triton can always parse it. Without
tritonclient (it is a test dependency, not a runtime one) the same text is written directly;
the tests check that both parse into the same message.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Fields whose values are enum names (bare words in text format, not quoted strings).
_ENUMS = {"data_type", "kind", "format"}
# map<string, ...> fields of the messages Kiln writes: text format spells each entry out.
_MAPS = {"parameters", "inputs"}


def config_text(config: dict[str, Any], header: Sequence[str] = ()) -> str:
    """The config.pbtxt text of `config` (ModelConfig JSON), after `header` as # comments."""
    schema = model_config_schema()
    body = _from_schema(config, schema) if schema is not None else _write(config, 0)
    # One comment line each: a newline in a path must not end the comment early.
    comments = "".join(f"# {' '.join(line.splitlines())}\n" for line in header)
    return comments + body


def model_config_schema() -> type | None:
    """Triton's ModelConfig message class, from tritonclient's `model_config_pb2`; None when
    tritonclient is not installed."""
    return _schema_module().ModelConfig if _schema_module() is not None else None


@functools.cache
def _schema_module() -> types.ModuleType | None:
    try:
        from tritonclient.grpc import model_config_pb2

        return model_config_pb2
    except (ImportError, RuntimeError):  # RuntimeError: no grpc extra, but the file is there
        pass
    try:
        spec = importlib.util.find_spec("tritonclient")
    except (ImportError, ValueError):  # ValueError: a module without a spec stands in for it
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "grpc" / "model_config_pb2.py"
    if not path.is_file():
        return None
    # Under its own name, so a later `import tritonclient.grpc` finds the message types it
    # registered in protobuf's pool.
    name = "tritonclient.grpc.model_config_pb2"
    if name in sys.modules:
        return sys.modules[name]
    loader = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    sys.modules[name] = module
    return module


def _from_schema(config: dict[str, Any], schema: type) -> str:
    from google.protobuf import json_format, text_format

    # A ParseError here is a bug in Kiln (a config Triton would refuse), not the user's input.
    message = json_format.ParseDict(config, schema())
    return text_format.MessageToString(message)


def _write(value: dict[str, Any], depth: int) -> str:
    """A message's fields in text format, as protobuf prints them (empty strings left out,
    as proto3 leaves out defaults)."""
    pad = "  " * depth
    lines = []
    for key, item in value.items():
        if key in _MAPS and isinstance(item, dict):
            for map_key, map_value in item.items():
                entry = {"key": map_key, "value": map_value}
                lines.append(f"{pad}{key} {{\n{_write(entry, depth + 1)}{pad}}}\n")
        elif isinstance(item, dict):
            lines.append(f"{pad}{key} {{\n{_write(item, depth + 1)}{pad}}}\n")
        elif isinstance(item, list):
            lines += [_element(pad, key, element, depth) for element in item]
        elif item != "":
            lines.append(f"{pad}{key}: {_scalar(key, item)}\n")
    return "".join(lines)


def _element(pad: str, key: str, element: Any, depth: int) -> str:
    if isinstance(element, dict):
        return f"{pad}{key} {{\n{_write(element, depth + 1)}{pad}}}\n"
    return f"{pad}{key}: {_scalar(key, element)}\n"


def _scalar(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if key in _ENUMS:
        return str(value)
    return json.dumps(str(value), ensure_ascii=False)  # quoted, escapes text format reads
