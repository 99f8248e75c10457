"""Long sequences: the zoo's long-context encoder, attention fused at long lengths with
no B·H·S² tensor left in the memory plan, and the benchmark that times it (benchmarks/long_seq.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

import kiln
from kiln import zoo
from kiln.cost.memory_plan import plan_memory
from kiln.ir.inputs import synthesize
from kiln.ir.load import graphs
from kiln.zoo import bert

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "long_seq.py"
NAME = "bert-base-4k"


def _initializer_dims(model: onnx.ModelProto) -> dict[str, list[int]]:
    return {t.name: list(t.dims) for t in model.graph.initializer}


def _scores_bytes(cfg: bert.BertConfig, seq: int) -> int:
    """One layer's attention scores at batch 1: heads × seq × seq float32."""
    return cfg.heads * seq * seq * 4


def _fused_attentions(model: onnx.ModelProto) -> int:
    """If branches included (kiln.passes.flash_attention wraps long attention in one)."""
    nodes = (n for g in graphs(model.graph) for n in g.node)
    return sum(n.domain == "com.microsoft" and n.op_type == "Attention" for n in nodes)


def test_bert_base_4k_is_listed_with_a_long_default_seq() -> None:
    e = zoo.entry(NAME)
    assert NAME in zoo.names() and not e.tiny
    assert e.dims == {"batch": 1, "seq": bert.LONG.max_positions}
    assert bert.LONG.max_positions == 4096
    assert dataclasses.replace(bert.FULL, max_positions=4096) == bert.LONG  # bert-base otherwise


def test_bert_base_4k_has_4096_positions_and_bert_base_shapes() -> None:
    model = zoo.build(NAME)  # built, never run at 4,096 here
    dims = _initializer_dims(model)
    cfg = bert.LONG
    assert dims["embeddings.position_embeddings.weight"] == [cfg.max_positions, cfg.hidden]
    assert dims["embeddings.position_ids"] == [1, cfg.max_positions]
    assert dims["embeddings.word_embeddings.weight"] == [cfg.vocab, cfg.hidden]
    assert [n.op_type for n in model.graph.node].count("Softmax") == cfg.layers
    props = {p.key: p.value for p in model.metadata_props}
    assert props["kiln.zoo"] == NAME


def test_bert_base_4k_runs_at_a_short_seq_under_session() -> None:
    session = kiln.Session(f"zoo:{NAME}")
    try:
        feeds = synthesize(session.interface, {"batch": 1, "seq": 64})
        hidden, pooled = session.run(None, feeds)
    finally:
        session.close()
    assert hidden.shape == (1, 64, bert.LONG.hidden) and pooled.shape == (1, bert.LONG.hidden)
    assert np.isfinite(hidden).all() and hidden.std() > 1e-3


def _long_tiny() -> tuple[bert.BertConfig, onnx.ModelProto]:
    """bert-base-4k's layout at bert-tiny's width: the same builder, 4,096 positions."""
    cfg = bert.BertConfig(layers=2, hidden=64, heads=4, ffn=256, vocab=1000, max_positions=4096)
    return cfg, bert.build(cfg, "bert-tiny-4k", {"batch": 1, "seq": 4096})


def test_attention_is_fused_at_a_long_seq_and_its_scores_leave_the_memory_plan(tmp_path) -> None:
    """Past bert-base's 512 positions the attention still fuses into com.microsoft Attention, one
    a layer, and the plan holds no heads × seq² tensor any more (the original holds the scores,
    scaled, masked, and the probabilities of every layer). ONNX Runtime's Attention kernel still
    makes one inside the node (see benchmarks/long_seq.py for the measured peak)."""
    cfg, model = _long_tiny()
    seq = 1024
    artifact = kiln.compile(model, tmp_path / "long.kiln", shapes={"seq": (seq,)})
    assert artifact.manifest.verification.ok
    compiled = onnx.load(artifact.path / "model.onnx")
    assert _fused_attentions(compiled) == cfg.layers
    # Compiled for 1,024 tokens: each layer can take ORT's mask-free flash kernel.
    assert sum(n.op_type == "If" for n in compiled.graph.node) == cfg.layers
    dims = {"batch": 1, "seq": seq}
    square = _scores_bytes(cfg, seq)
    before = [t for t in plan_memory(model, dims).tensors if t.bytes >= square]
    after = [t for t in plan_memory(compiled, dims).tensors if t.bytes >= square]
    assert sum(t.op_type == "Softmax" for t in before) == cfg.layers
    assert after == []


def _benchmark():
    if str(BENCHMARK.parent) not in sys.path:  # as when run: the script's directory comes first
        sys.path.insert(0, str(BENCHMARK.parent))
    spec = importlib.util.spec_from_file_location("long_seq_benchmark", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_help_explains_itself() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARK), "--help"], capture_output=True, text=True, check=True
    )
    for option in ("--seqs", "--gpt2-seqs", "--rounds", "--runs", "--work", "--no-memory"):
        assert option in done.stdout
    assert "4,096" in done.stdout and "cosine" in done.stdout


def _engine(speedup: float, peak_mib: float) -> dict:
    return {"speedup": speedup, "memory": {"peak_mib": peak_mib}}


def test_benchmark_checks_the_done_means_at_4096() -> None:
    bench = _benchmark()
    engines = {
        "ort": _engine(1.0, 3000.0),
        "openvino": _engine(1.1, 900.0),
        "openvino-bf16": _engine(2.5, 700.0),
        "kiln": _engine(1.4, 1500.0),
        "kiln-budget": _engine(2.6, 800.0),
    }
    short = {"model": bench.BERT, "seq": 512, "engines": {**engines, "kiln": _engine(0.9, 9e3)}}
    cells = [short, {"model": bench.BERT, "seq": 4096, "engines": engines}]
    found = bench.checks(cells, ["openvino", "openvino-bf16"])
    assert found["seq"] == 4096 and found["kiln_speedup_ok"]
    assert found["kiln_memory_share"] == pytest.approx(0.5) and found["kiln_memory_ok"]
    assert found["best_peer"] == "openvino-bf16" and found["budget_ok"]
    engines["kiln-budget"] = _engine(2.4, 800.0)
    assert not bench.checks(cells, ["openvino", "openvino-bf16"])["budget_ok"]


@pytest.mark.slow
def test_bert_base_4k_compiles_fused_at_1024(tmp_path) -> None:
    seq = 1024
    artifact = kiln.compile(f"zoo:{NAME}", tmp_path / "b.kiln", shapes={"seq": (seq,)}, rounds=0)
    assert artifact.manifest.verification.ok
    compiled = onnx.load(artifact.path / "model.onnx", load_external_data=False)
    assert _fused_attentions(compiled) == bert.LONG.layers
    square = _scores_bytes(bert.LONG, seq)
    plan = plan_memory(compiled, {"batch": 1, "seq": seq})
    assert [t for t in plan.tensors if t.bytes >= square] == []


@pytest.mark.slow
def test_bert_base_4k_runs_at_4096() -> None:
    session = kiln.Session(f"zoo:{NAME}")
    try:
        feeds = synthesize(session.interface, {"batch": 1, "seq": 4096})
        hidden, _ = session.run(None, feeds)
    finally:
        session.close()
    assert hidden.shape == (1, 4096, bert.LONG.hidden) and np.isfinite(hidden).all()
