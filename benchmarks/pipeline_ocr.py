"""RapidOCR's OCR pipeline on many streams: Kiln's pipeline runtime against RapidOCR as its
users run it, MLPerf MultiStream-shaped, with pre- and post-processing timed.

    kiln optimize benchmarks/ocr_pipeline.py:read_text \
        --model det=... --model cls=... --model rec=...    (the models: ocr_pipeline.MODELS)
        --data benchmarks/pipeline_ocr.py:images --metric benchmarks/ocr_pipeline.py:lines_equal \
        --backend auto --max-drop 0.01 --streams 16 -o ocr.kiln
                                      (each stage on its faster engine, fp32, built for 16 streams)
    python benchmarks/pipeline_ocr.py [--artifact ocr.kiln] [--streams 1,4,16] [--images 24] \
        [--json out.json]

The pipeline is benchmarks/ocr_pipeline.py:read_text — RapidOCR 1.4.4's own glue over the
wheel's PP-OCRv4 detector, orientation classifier and recogniser. The images are made here,
offline: lines of the Python standard library's source rendered with the fonts Debian ships
at several sizes, slants and noise levels, and the scanned page scikit-image ships. Per stream
count, each stream takes the next image when its last is answered; three ways run the same
images:
- `rapidocr`: `RapidOCR()` as its users run it — one engine per worker thread, or one shared
  by all (the faster of the two is kept, both are in the file);
- `plain_artifacts`: the same function over the same per-stage models (the artifact's
  stages, or without --artifact the wheel's models) opened as `kiln.Session`, one thread per
  stream, no pipeline runtime (the runtime's share, isolated);
- `kiln`: `kiln.Pipeline(artifact).map(streams=N)`, each model's calls pooled across streams.
Per way: queries answered, P50/P90/P99 per query (and how many queries back the P99),
queries/s; `lines_equal` (share of images whose text lines equal RapidOCR's) and `cer` (the
character error rate against RapidOCR's text). The default run takes about 6 minutes on
2 cores (each result file's `seconds` says how long its run took)."""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from _results import Recorder, add_arguments, row

from kiln.pipeline.bench import run_queries

FONTS = Path("/usr/share/fonts/truetype")


def make_images(count: int, seed: int = 0) -> list[np.ndarray]:
    """`count` RGB images: text lines rendered offline, and scikit-image's scanned page."""
    from PIL import Image, ImageDraw, ImageFont
    from skimage import data

    rng = random.Random(seed)
    fonts = sorted(FONTS.rglob("*.ttf"))
    words = Path(json.__file__).read_text().split()
    images = [np.ascontiguousarray(np.stack([data.page()] * 3, -1))]
    while len(images) < count:
        size = rng.choice((16, 20, 24, 32))
        font = ImageFont.truetype(str(rng.choice(fonts)), size)
        lines = [" ".join(rng.sample(words, rng.randint(3, 7))) for _ in range(rng.randint(1, 4))]
        canvas = Image.new("RGB", (640, 40 + len(lines) * size * 2), "white")
        draw = ImageDraw.Draw(canvas)
        for i, line in enumerate(lines):
            draw.text((20, 20 + i * size * 2), line, fill="black", font=font)
        canvas = canvas.rotate(rng.choice((0, 0, 2, -3)), expand=True, fillcolor="white")
        pixels = np.asarray(canvas, np.float32)
        pixels += np.random.default_rng(len(images)).normal(0, rng.choice((0, 8, 16)), pixels.shape)
        images.append(np.clip(pixels, 0, 255).astype(np.uint8))
    return images


def images() -> list[np.ndarray]:
    """The default data set, for `kiln optimize ... --data benchmarks/pipeline_ocr.py:images`."""
    return make_images(24)


def levenshtein(a: str, b: str) -> int:
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def figures(results, seconds, wall, reference) -> dict[str, Any]:
    from ocr_pipeline import lines

    ms = np.array(seconds) * 1e3
    texts = ["\n".join(lines(r)) for r in results]
    truth = ["\n".join(lines(r)) for r in reference]
    pairs = list(zip(texts, truth, strict=True))
    errors = sum(levenshtein(t, r) for t, r in pairs)
    return {
        "queries": len(results), "queries_per_s": round(len(results) / wall, 3),
        "p50_ms": round(float(np.percentile(ms, 50)), 2),
        "p90_ms": round(float(np.percentile(ms, 90)), 2),
        "p99_ms": round(float(np.percentile(ms, 99)), 2),
        "p99_backed_by": len(results),
        "lines_equal": round(float(np.mean([t == r for t, r in pairs])), 4),
        "cer": round(errors / max(1, sum(len(r) for r in truth)), 5),
    }  # fmt: skip


def rapidocr_way(images, streams, reference, per_thread: bool) -> dict[str, Any]:
    from rapidocr_onnxruntime import RapidOCR

    engines = [RapidOCR() for _ in range(streams if per_thread else 1)]
    engines[0](images[0])  # warm
    spare, mine = list(engines), threading.local()  # made before the clock: one a thread

    def answer(image: np.ndarray, _index: int) -> Any:
        if not hasattr(mine, "engine"):
            mine.engine = spare.pop() if per_thread else engines[0]
        return mine.engine(image)[0]

    return figures(*run_queries(answer, images, streams), reference)


def plain_way(images, streams, reference, sessions) -> dict[str, Any]:
    from ocr_pipeline import read_text

    read_text(images[0], **sessions)  # warm
    return figures(
        *run_queries(lambda img, _i: read_text(img, **sessions), images, streams), reference
    )


def kiln_way(images, streams, reference, pipe) -> dict[str, Any]:
    pipe(images[0])  # warm
    start = time.perf_counter()
    results = pipe.map(images, streams=streams)
    wall = time.perf_counter() - start
    out = figures(results, pipe.last_run.seconds, wall, reference)
    out["stages"] = pipe.last_run.stages
    return out


def measure(images: list[np.ndarray], counts: list[int], artifact: Path | None) -> dict[str, Any]:
    """Each way at each stream count. `artifact`: the OCR pipeline compiled by Kiln (its
    stages' artifacts run both under Kiln's runtime and from the plain function); None: the
    wheel's models as they are, opened as kiln.Session (the runtime's share alone)."""
    from ocr_pipeline import MODELS, read_text
    from rapidocr_onnxruntime import RapidOCR

    import kiln
    from kiln.pipeline import Pipeline

    engine = RapidOCR()
    reference = [engine(image)[0] for image in images]
    if artifact is not None:
        stages = {name: artifact / "stages" / f"{name}.kiln" for name in MODELS}
    else:
        stages = dict(MODELS)
    sessions = {name: kiln.Session(str(path)) for name, path in stages.items()}
    pipe_source: Any = (str(artifact), None) if artifact is not None else (read_text, sessions)
    out: dict[str, Any] = {}
    with Pipeline(*pipe_source) as pipe:
        for n in counts:
            print(f"{n} streams ...", file=sys.stderr, flush=True)
            ways = {
                "rapidocr_per_thread": rapidocr_way(images, n, reference, per_thread=True),
                "rapidocr_shared": rapidocr_way(images, n, reference, per_thread=False),
                "plain_artifacts": plain_way(images, n, reference, sessions),
                "kiln": kiln_way(images, n, reference, pipe),
            }
            best = max(
                ("rapidocr_per_thread", "rapidocr_shared"), key=lambda w: ways[w]["queries_per_s"]
            )
            ways["rapidocr"] = {**ways[best], "way": best}
            ways["speedup"] = round(
                ways["kiln"]["queries_per_s"] / ways["rapidocr"]["queries_per_s"], 3
            )
            ways["p99_ratio"] = round(ways["kiln"]["p99_ms"] / ways["rapidocr"]["p99_ms"], 3)
            ways["runtime_share"] = round(
                ways["kiln"]["queries_per_s"] / ways["plain_artifacts"]["queries_per_s"], 3
            )
            ways["lines_equal"], ways["cer"] = ways["kiln"]["lines_equal"], ways["kiln"]["cer"]
            out[str(n)] = ways
    return out


def _choices(artifact: Path | None) -> dict[str, Any] | None:
    """What the compiled pipeline chose per stage, and its metric, from its pipeline.json."""
    if artifact is None:
        return None
    manifest = json.loads((artifact / "pipeline.json").read_text())
    return {"stages": {n: s["precision"] for n, s in manifest["stages"].items()},
            "engines": {n: s.get("engine", "") for n, s in manifest["stages"].items()},
            "metric": manifest["metric"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", default="1,4,16", help="stream counts (default 1,4,16)")
    parser.add_argument("--images", type=int, default=24, help="images per stream count")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument(
        "--artifact", type=Path,
        help="the OCR pipeline compiled by `kiln optimize benchmarks/ocr_pipeline.py:read_text "
        "... -o OCR.kiln` (default: the wheel's models as they are)",
    )  # fmt: skip
    add_arguments(parser)
    args = parser.parse_args()
    recorder = Recorder("pipeline_ocr")
    counts = [int(n) for n in args.streams.split(",")]
    streams = measure(make_images(args.images), counts, args.artifact)
    document = {"machine": recorder.machine, "streams": streams,
                "artifact": _choices(args.artifact)}  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    rows = []
    for n, ways in streams.items():
        rows.append(row(f"{n} streams: kiln / rapidocr queries/s", ways["speedup"], "x",
                        model="pp-ocrv4", engine="kiln", baseline="rapidocr"))  # fmt: skip
        rows.append(row(f"{n} streams: kiln / rapidocr P99", ways["p99_ratio"], "x",
                        model="pp-ocrv4", engine="kiln", baseline="rapidocr"))  # fmt: skip
        rows.append(row(f"{n} streams: pipeline runtime / plain function queries/s",
                        ways["runtime_share"], "x", model="pp-ocrv4", engine="kiln",
                        baseline="plain_artifacts"))  # fmt: skip
    path = recorder.write(rows, document, args.results)
    keys = ("speedup", "p99_ratio", "runtime_share", "lines_equal", "cer")
    print(json.dumps({n: {k: ways[k] for k in keys} for n, ways in streams.items()}, indent=1))
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
