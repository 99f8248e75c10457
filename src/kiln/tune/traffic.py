"""Traffic a served study replays: the request shapes production sends (`kiln tune --clients N
--traffic FILE`), so that bucket sets are searched against the shapes that will really come.

The file is JSON: a list of requests, each an object giving a size to every dynamic dim of the
model's inputs but the batch dim, and optionally the batch dim (samples in the request,
default 1), e.g. `[{"seq": 12}, {"seq": 40}, {"batch": 4, "seq": 128}]`. Or `served:NAME`: the
shapes `kiln serve --feedback` recorded for model NAME in the strategy library's windows —
production traffic tuning the next build. (Windows count executed runs, whose batch dim is the
batcher's merged batch, not a request's: only the other dims are taken, one sample each.)
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx_ir as ir

from kiln.errors import KilnError
from kiln.ir.inputs import named_dims, synthesize

Shape = dict[str, int]
Feeds = dict[str, np.ndarray]
PER_DIM = (0, 1, 2, 4, 8)  # buckets per dim a study tries; 0: none, the dynamic executable


SERVED = "served:"
REPLAYED = 256  # requests a window's histogram is scaled to


def load_traffic(spec: str | Path, url: str) -> list[Shape]:
    """`--traffic FILE`, `--traffic '[{"seq": 12}, ...]'` (the JSON itself) or `--traffic
    served:NAME` (windows in the library at `url`)."""
    if str(spec).startswith(SERVED):
        return recorded_traffic(str(spec)[len(SERVED) :], url)
    if str(spec).lstrip().startswith(("[", "{")):  # no file name starts so: the JSON itself
        return read_traffic(spec, inline=True)
    return read_traffic(spec)


def recorded_traffic(model: str, url: str) -> list[Shape]:
    """Requests in the proportions of the shapes the feedback loop saw for `model`, batch dims
    dropped (see the module docstring), interleaved."""
    from kiln.tune.library import Library

    counts: Counter[tuple] = Counter()
    for window in Library(url).windows(model):
        for key, n in window.get("shapes", {}).items():
            dims = dict(part.split("=") for part in key.split(",") if "=" in part)
            counts[tuple((d, int(v)) for d, v in sorted(dims.items()) if d != "batch")] += n
    counts.pop((), None)
    if not counts:
        raise KilnError(
            f"--traffic {SERVED}{model}: the strategy library holds no windows with dynamic dims "
            f"for '{model}'; serve it with kiln serve --feedback first, or give a JSON file."
        )
    total = sum(counts.values())
    share = [(dict(k), max(1, round(REPLAYED * n / total))) for k, n in counts.most_common()]
    pool = [dims for dims, n in share for _ in range(n)]
    order = np.random.default_rng(0).permutation(len(pool))
    return [pool[i] for i in order]


def read_traffic(path: str | Path, inline: bool = False) -> list[Shape]:
    """The requests' dims as the file (or, `inline`, the text itself) lists them
    (well-formed; the model is not checked yet)."""
    where = f"--traffic {str(path)[:60]}"
    try:
        data = json.loads(str(path) if inline else Path(path).read_text())
    except FileNotFoundError:
        raise KilnError(f"{where}: no such file (or give the JSON itself, e.g. "
                        '''--traffic '[{"seq": 12}]').''') from None  # fmt: skip
    except json.JSONDecodeError as exc:
        what = "not valid JSON" if inline else "not a JSON file"
        raise KilnError(f"{where}: {what} ({exc}).") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise KilnError(f"{where}: not a JSON file ({exc}).") from None
    if not isinstance(data, list) or not data:
        raise KilnError(
            f'{where}: expected a non-empty JSON list of requests, e.g. [{{"seq": 12}}].'
        )
    for i, request in enumerate(data):
        good = isinstance(request, dict) and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in request.values()
        )
        if not good:
            raise KilnError(
                f"{where}: request {i} is {json.dumps(request)[:80]}; each request is an object "
                'of dim sizes ≥ 1, e.g. {"seq": 12}.'
            )
    return data


def dynamic_dims(model: ir.Model) -> list[str]:
    """The named dims of the model's inputs, in order of first appearance."""
    out: list[str] = []
    for value in model.graph.inputs:
        if value.name not in model.graph.initializers:
            out += [name for _, name in named_dims(value) if name not in out]
    return out


def check_traffic(traffic: list[Shape], model: ir.Model, batch: str | None) -> list[Shape]:
    """Every request with a size for each dynamic dim (the batch dim 1 unless given), or a
    clear refusal naming the dim the model does not have or the request does not give."""
    dims = dynamic_dims(model)
    need = [d for d in dims if d != batch]
    out = []
    for i, request in enumerate(traffic):
        unknown = sorted(set(request) - set(dims))
        if unknown:
            raise KilnError(
                f"--traffic: request {i} sizes '{unknown[0]}', which the model has no dim of; "
                f"its dynamic dims are {', '.join(dims) or 'none'}."
            )
        missing = [d for d in need if d not in request]
        if missing:
            raise KilnError(f"--traffic: request {i} gives no size for dim '{missing[0]}'.")
        out.append({**({batch: 1} if batch else {}), **request})
    return out


def traffic_feeds(model: ir.Model, traffic: list[Shape]) -> list[Feeds]:
    """One request's inputs per traffic entry (synthesized once per distinct shape), in order."""
    made: dict[tuple, Feeds] = {}
    out = []
    for request in traffic:
        key = tuple(sorted(request.items()))
        if key not in made:
            made[key] = synthesize(model, dims=dict(request))
        out.append(made[key])
    return out
