"""transformers BERT (2 and 3 inputs) and GPT-2 (with and without
attention_mask), each exported by both PyTorch exporters, compiled by Kiln and timed
against ONNX Runtime (ORT_ENABLE_ALL) on the export, next to the zoo twins the same way.

    python benchmarks/hf_exports.py [--layers 4] [--seq 128] [--rounds 7] [--runs 10]
                                    [--json results/hf_exports.json]

Random weights, nothing downloaded. The HF models take the zoo twins' width (hidden 768,
12 heads, the real vocabularies) and `--layers` layers; the twins are the full zoo:bert-base
and zoo:gpt2. What compares is each model's Kiln/ORT ratio: P50s interleaved round by
round in one process (the machine is shared), with the range of per-round ratios. The
default run compiles and times the two full-size twins and eight 4-layer exports: roughly
15 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
import transformers
from _results import Recorder, add_arguments, row  # benchmarks/ is the script's own directory

import kiln
from kiln import zoo
from kiln.timing import verdict_of

INPUTS = {
    "bert3": ["input_ids", "attention_mask", "token_type_ids"],
    "bert2": ["input_ids", "attention_mask"],
    "gpt2": ["input_ids"],
    "gpt2-mask": ["input_ids", "attention_mask"],
}
TWINS = {"bert3": "bert-base", "bert2": "bert-base", "gpt2": "gpt2", "gpt2-mask": "gpt2"}
FUSED = ["Attention", "SkipLayerNormalization", "LayerNormalization", "Gelu", "FastGelu",
         "BiasGelu", "Softmax"]  # fmt: skip


class Positional(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, names: list[str]) -> None:
        super().__init__()
        self.model, self.names = model, names

    def forward(self, input_ids, attention_mask=None, token_type_ids=None):
        given = {"attention_mask": attention_mask, "token_type_ids": token_type_ids}
        kwargs = {name: given[name] for name in self.names[1:]}
        return self.model(input_ids=input_ids, **kwargs, return_dict=False)[0]


def hf_model(variant: str, layers: int) -> tuple[torch.nn.Module, int]:
    torch.manual_seed(0)
    if variant.startswith("bert"):
        config = transformers.BertConfig(num_hidden_layers=layers)
        model = transformers.BertModel(config, add_pooling_layer=False)
    else:
        config = transformers.GPT2Config(n_layer=layers)
        model = transformers.GPT2Model(config)
    return Positional(model.eval(), INPUTS[variant]), config.vocab_size


def export(variant: str, exporter: str, layers: int, path: Path) -> int:
    names = INPUTS[variant]
    model, vocab = hf_model(variant, layers)
    ids = torch.randint(0, vocab, (1, 16))
    every = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "token_type_ids": torch.zeros_like(ids)}  # fmt: skip
    args = tuple(every[n] for n in names)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "torchscript":
            torch.onnx.export(
                model, args, str(path), input_names=names, output_names=["hidden"],
                dynamic_axes={n: {0: "batch", 1: "seq"} for n in names}, opset_version=17,
                dynamo=False,
            )  # fmt: skip
        else:
            batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
            program = torch.onnx.export(
                model, args, input_names=names, output_names=["hidden"],
                dynamic_shapes=tuple({0: batch, 1: seq} for _ in names), dynamo=True,
                verbose=False,
            )  # fmt: skip
            program.save(str(path))
    return vocab


def feeds_for(model_path: Path, seq: int, vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {}
    for value in onnx.load(str(model_path), load_external_data=False).graph.input:
        name = value.name
        if "mask" in name:
            feeds[name] = np.ones((1, seq), np.int64)
        elif "type" in name:
            feeds[name] = np.zeros((1, seq), np.int64)
        else:
            feeds[name] = rng.integers(0, vocab, (1, seq)).astype(np.int64)
    return feeds


def interleaved(source: Path, artifact: Path, feeds, rounds: int, runs: int) -> dict:
    """P50s of ORT (ORT_ENABLE_ALL, the export) and the Kiln artifact, round by round."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    engines = {
        "ort": ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"]),
        "kiln": kiln.Session(artifact),
    }
    p50s: dict[str, list[float]] = {name: [] for name in engines}
    for session in engines.values():
        session.run(None, feeds)  # warm-up
    for _ in range(rounds):
        for name, session in engines.items():
            times = []
            for _ in range(runs):
                start = time.perf_counter()
                session.run(None, feeds)
                times.append((time.perf_counter() - start) * 1e3)
            p50s[name].append(float(np.median(times)))
    ratios = [o / k for o, k in zip(p50s["ort"], p50s["kiln"], strict=True)]
    return {
        "ort_p50_ms": float(np.median(p50s["ort"])),
        "kiln_p50_ms": float(np.median(p50s["kiln"])),
        "speedup": float(np.median(p50s["ort"]) / np.median(p50s["kiln"])),
        "speedup_range": [min(ratios), max(ratios)],
    }


def compile_and_time(source: Path, out: Path, seq: int, vocab: int, args) -> dict:
    start = time.perf_counter()
    artifact = kiln.compile(source, out)
    compile_s = time.perf_counter() - start
    counts = collections.Counter(n.op_type for n in onnx.load(str(artifact.model_path)).graph.node)
    manifest = artifact.manifest
    return {
        "nodes_before": manifest.nodes["before"],
        "nodes_after": manifest.nodes["after"],
        "fused": {op: counts[op] for op in FUSED},
        "verified": manifest.verification.ok,
        "dropped_passes": manifest.dropped_passes,
        "unfused_notes": [n for n in manifest.notes if "stayed unfused" in n],
        "compile_s": round(compile_s, 1),
        **interleaved(source, artifact.path, feeds_for(source, seq, vocab), args.rounds, args.runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--variants", default=",".join(INPUTS))
    parser.add_argument("--exporters", default="torchscript,dynamo")
    parser.add_argument("--json", default="results/hf_exports.json")
    add_arguments(parser)
    args = parser.parse_args()
    recorder = Recorder("hf_exports")
    results: dict = {"command": " ".join(sys.argv), "layers": args.layers, "seq": args.seq,
                     "exports": {}, "twins": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kiln-hf-") as tmp:
        work = Path(tmp)
        for twin in sorted({TWINS[v] for v in args.variants.split(",")}):
            source = work / f"{twin}.onnx"
            onnx.save(zoo.build(twin), str(source))
            vocab = 30522 if twin.startswith("bert") else 50257
            results["twins"][twin] = compile_and_time(
                source, work / f"{twin}.kiln", args.seq, vocab, args
            )
            print(twin, json.dumps(results["twins"][twin]), flush=True)
        for variant in args.variants.split(","):
            for exporter in args.exporters.split(","):
                label = f"{variant}/{exporter}"
                source = work / f"{variant}-{exporter}.onnx"
                vocab = export(variant, exporter, args.layers, source)
                entry = compile_and_time(source, work / f"{variant}-{exporter}.kiln",
                                         args.seq, vocab, args)  # fmt: skip
                entry["twin"] = TWINS[variant]
                results["exports"][label] = entry
                print(label, json.dumps(entry), flush=True)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".json.tmp")
    partial.write_text(json.dumps(results, indent=2))
    partial.replace(out)
    found = {**results["twins"], **results["exports"]}
    recorder.write([
        row(f"{label}: Kiln vs ONNX Runtime", entry["speedup"], "x", entry["speedup_range"],
            verdict_of(*entry["speedup_range"]), model=label, engine="kiln", baseline="ort",
            verified=entry["verified"])
        for label, entry in found.items()
    ], results, args.results)  # fmt: skip


if __name__ == "__main__":
    main()
