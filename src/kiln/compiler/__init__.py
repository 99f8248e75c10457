"""The compiler: one compile is load → passes → precision → verify → artifact, driven by a
`CompileConfig`; `engine="auto"` / `precision="auto"` build every candidate and keep the fastest
verified one."""

from kiln.compiler.api import build, compile, save_result
from kiln.compiler.candidate import CompileResult, compile_candidate, engine_options
from kiln.compiler.memory import fit_candidates, fit_memory
from kiln.compiler.select import candidates, fastest, time_candidates
from kiln.config import CompileConfig

__all__ = [
    "CompileConfig",
    "CompileResult",
    "build",
    "candidates",
    "compile",
    "compile_candidate",
    "engine_options",
    "fastest",
    "fit_candidates",
    "fit_memory",
    "save_result",
    "time_candidates",
]
