"""Loading, validating, fingerprinting and provenance-stamping models."""

from kiln.ir.load import load_model, resolve_source
from kiln.ir.provenance import ORIGIN_KEY, PASS_KEY, all_nodes, origins_of, stamp_origins

__all__ = [
    "ORIGIN_KEY",
    "PASS_KEY",
    "all_nodes",
    "load_model",
    "origins_of",
    "resolve_source",
    "stamp_origins",
]
