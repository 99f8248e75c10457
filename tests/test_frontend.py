"""PyTorch in: `kiln.compile(module, example_inputs=...)` and `kiln optimize model.pt2` give
verified artifacts, checked against PyTorch's own outputs, traced to module and source line.

Needs torch (and transformers for the BERT test); skipped cleanly without them.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import numpy as np
import onnx
import pytest

import kiln
from kiln.errors import KilnError

torch = pytest.importorskip("torch")
nn = torch.nn

from kiln.frontend import to_onnx  # noqa: E402  (after the importorskip)


class Block(nn.Module):
    """conv → batch-norm → ReLU, torchvision style."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(Block(3, 8), nn.MaxPool2d(2), Block(8, 16), nn.MaxPool2d(2))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))


class Branchy(nn.Module):
    """A branch on a tensor's values: torch.export rejects it."""

    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x - 1


def _line_of(method, text: str) -> str:
    """`file:line` of the line of `method` holding `text` (derived, never typed in)."""
    lines, start = inspect.getsourcelines(method)
    offset = next(i for i, line in enumerate(lines) if text in line)
    return f"{inspect.getsourcefile(method)}:{start + offset}"


BLOCK_LINE = _line_of(Block.forward, "return self.act")


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    model = SmallCNN()
    with torch.no_grad():  # batch-norm statistics that are not the identity
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
    return model.eval()


def _close_to_torch(outputs: list[np.ndarray], expected: list) -> None:
    """Within Kiln's fp32 tolerance of PyTorch: max abs ≤ 1e-4 · the output's scale."""
    assert len(outputs) == len(expected)
    for got, want in zip(outputs, expected, strict=True):
        want = want.detach().numpy()
        scale = max(float(np.abs(want).max()), 1e-3)
        assert got.shape == want.shape
        assert float(np.abs(got - want).max()) <= 1e-4 * scale


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    """The CNN compiled once through the front-end, batch dim dynamic; handed over in
    training mode, as a user fresh from fine-tuning would."""
    where = tmp_path_factory.mktemp("cnn")
    model, example = _cnn().train(), torch.rand(2, 3, 32, 32)
    artifact = kiln.compile(
        model,
        where / "cnn.kiln",
        example_inputs=(example,),
        dynamic_shapes=({0: "batch"},),
        rounds=0,
    )
    assert model.training  # exported and checked in eval mode, then left as it was
    return model.eval(), example, artifact


def test_cnn_compiles_verified_against_torch(cnn):
    model, example, artifact = cnn
    verification = artifact.manifest.verification
    assert verification.ok and verification.inputs == "example_inputs"
    torch_check = verification.torch
    assert torch_check["framework"] == "torch" and torch_check["ok"] and torch_check["export_ok"]
    for output in torch_check["outputs"]:
        assert output["max_abs"] <= output["bound"] and output["cosine"] > 0.9999
    assert artifact.manifest.nodes["after"] < artifact.manifest.nodes["before"]  # fused
    with kiln.Session(artifact.path) as session:
        outputs = session.run(None, {"x": example.numpy()})
    with torch.no_grad():
        _close_to_torch(outputs, [model(example)])


def test_dynamic_batch_runs_at_another_batch(cnn):
    model, _, artifact = cnn
    assert artifact.manifest.inputs[0]["shape"][0] == "batch"
    other = torch.rand(5, 3, 32, 32)
    with kiln.Session(artifact.path) as session:
        outputs = session.run(None, {"x": other.numpy()})
    with torch.no_grad():
        _close_to_torch(outputs, [model(other)])


def test_provenance_names_module_and_source_line(cnn):
    _, _, artifact = cnn
    provenance = artifact.provenance()
    first = next(e for e in provenance.values() if "features.0.conv" in e.get("module", []))
    # the exporter's own Conv+BatchNorm fusion and Kiln's Conv+ReLU fusion both keep every
    # module they merged, and the line is the test's own Block.forward, not torch's
    assert {"features.0.conv", "features.0.bn", "features.0.act"} <= set(first["module"])
    assert first["source"] == [BLOCK_LINE]
    every = {m for entry in provenance.values() for m in entry.get("module", [])}
    assert every <= {name for name, _ in _cnn().named_modules()}


def test_profile_and_compare_rows_name_module_and_source(cnn, tmp_path):
    from kiln.debug.compare import compare
    from kiln.hardware import Peaks
    from kiln.profile import profile_model

    model, example, artifact = cnn
    peaks = Peaks(  # the rows are checked here, not the roofline: no measuring
        fp32_gflops=100.0, bf16_gflops=200.0, int8_gops=400.0, bandwidth_gbs=20.0, threads=2,
        measured_at="test",
    )  # fmt: skip
    result = profile_model(str(artifact.path), runs=3, rounds=1, peaks=peaks)
    conv = next(n for n in result["nodes"] if "features.2.conv" in n["module"])
    assert BLOCK_LINE in conv["source"]
    from kiln.report.html import render_html

    page = render_html(result)  # the HTML report names them too
    assert "PyTorch module · source" in page and "features.0.conv" in page
    exported = tmp_path / "cnn.onnx"
    proto = to_onnx(model, (example,), dynamic_shapes=({0: "batch"},))
    keys = {p.key for node in proto.graph.node for p in node.metadata_props}
    assert {"pkg.torch.onnx.name_scopes", "pkg.torch.onnx.stack_trace"} <= keys
    onnx.save(proto, exported)
    rows = compare(str(exported), str(artifact.path)).to_json()["layers"]
    traced = [row for row in rows if "features.0.act" in row["module"]]
    assert traced and all(row["source"] == [BLOCK_LINE] for row in traced)
    assert rows[-1]["module"] == ["fc"]  # the logits come from the head


def test_bert_compiles_verified_against_torch(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    layers = 2
    config = transformers.BertConfig(
        vocab_size=200, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.BertModel(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 16))
    example = (ids, torch.ones_like(ids), torch.zeros_like(ids))
    artifact = kiln.compile(model, tmp_path / "bert.kiln", example_inputs=example, rounds=0)
    verification = artifact.manifest.verification
    assert verification.ok and verification.torch["ok"]
    assert [o["name"] for o in verification.torch["outputs"]] == [
        o["name"] for o in artifact.manifest.outputs
    ]
    feeds = dict(zip(["input_ids", "attention_mask", "token_type_ids"], example, strict=True))
    with kiln.Session(artifact.path) as session:
        outputs = session.run(None, {k: v.numpy() for k, v in feeds.items()})
    with torch.no_grad():
        expected = model(*example)
    _close_to_torch(outputs, [expected.last_hidden_state, expected.pooler_output])
    modules = {m for entry in artifact.provenance().values() for m in entry.get("module", [])}
    queries = {f"encoder.layer.{i}.attention.self.query" for i in range(layers)}
    assert queries <= modules


def test_pt2_through_the_cli(tmp_path):
    model, example = _cnn(), torch.rand(2, 3, 32, 32)
    batch = torch.export.Dim("batch")
    program = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
    torch.export.save(program, tmp_path / "m.pt2")
    result = subprocess.run(
        [sys.executable, "-m", "kiln", "optimize", "m.pt2", "-o", "x.kiln", "--rounds", "0",
         "--json"],
        cwd=tmp_path, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)  # nothing of the exporter's chatter on stdout
    assert summary["verification"]["ok"] and summary["verification"]["torch"]["ok"]
    assert summary["source"]["path"] == str(tmp_path / "m.pt2")
    provenance = json.loads((tmp_path / "x.kiln" / "provenance.json").read_text())
    assert any(BLOCK_LINE in entry.get("source", []) for entry in provenance.values())

    # The dynamic batch is named `batch` (not torch's `s77`), so buckets can name it.
    artifact = kiln.Session(tmp_path / "x.kiln", buckets="batch=1,2")
    with artifact as session:
        assert session.get_inputs()[0].shape[0] == "batch"
        outputs = session.run(None, {"x": example[:1].numpy()})
    with torch.no_grad():
        _close_to_torch(outputs, [model(example[:1])])

    # The artifact's original is the .pt2, found again (and exported again) by compare.
    compared = subprocess.run(
        [sys.executable, "-m", "kiln", "compare", "m.pt2", "x.kiln", "--json"],
        cwd=tmp_path, capture_output=True, text=True,
    )  # fmt: skip
    assert compared.returncode == 0, compared.stderr
    report = json.loads(compared.stdout)
    assert report["first_divergence"] is None and report["layers"]


def test_program_dims_keep_their_names(tmp_path):
    class Pair(nn.Module):
        def forward(self, x, y):
            return x.sum(1) + y[:, 0]

    batch, width = torch.export.Dim("batch"), torch.export.Dim("width")
    program = torch.export.export(
        Pair(), (torch.rand(2, 4), torch.rand(2, 5)),
        dynamic_shapes=({0: batch, 1: width}, {0: batch}),
    )  # fmt: skip

    def dims(proto: onnx.ModelProto) -> list[list]:
        values = [*proto.graph.input, *proto.graph.output]
        return [[d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in values]

    assert dims(to_onnx(program)) == [["batch", "width"], ["batch", 5], ["batch"]]
    # torch.export.save keeps no Dim names: the leading dim is `batch`, the rest by input
    torch.export.save(program, tmp_path / "p.pt2")
    loaded = torch.export.load(tmp_path / "p.pt2")
    assert dims(to_onnx(loaded)) == [["batch", "x_dim1"], ["batch", 5], ["batch"]]


def test_truncated_pt2_is_one_line_without_a_traceback(tmp_path):
    program = torch.export.export(_cnn(), (torch.rand(1, 3, 32, 32),))
    torch.export.save(program, tmp_path / "m.pt2")
    whole = (tmp_path / "m.pt2").read_bytes()
    (tmp_path / "m.pt2").write_bytes(whole[: len(whole) // 2])
    result = subprocess.run(
        [sys.executable, "-m", "kiln", "optimize", "m.pt2", "-o", "x.kiln"],
        cwd=tmp_path, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 2
    assert "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "m.pt2: cannot be read as a torch.export program" in result.stderr
    assert not (tmp_path / "x.kiln").exists()


def test_wrong_example_inputs_are_named_not_the_module():
    with pytest.raises(KilnError) as caught:
        to_onnx(_cnn(), (torch.rand(2, 5, 32, 32),))  # 5 channels; the CNN takes 3
    message = str(caught.value)
    assert message.startswith("SmallCNN: example_inputs do not fit the module")
    assert "3 channels" in message and "Fix the module" not in message and "\n" not in message


def test_wrong_dynamic_shapes_are_named_not_the_module():
    with pytest.raises(KilnError) as caught:  # the channel dim is fixed by the conv weight
        to_onnx(_cnn(), (torch.rand(2, 3, 32, 32),), dynamic_shapes=({1: "channels"},))
    message = str(caught.value)
    assert message.startswith("SmallCNN: dynamic_shapes ({1: 'channels'},) does not fit")
    assert "Fix the module" not in message and "\n" not in message


def test_pt2_without_torch_says_how_to_install(tmp_path):
    (tmp_path / "m.pt2").write_bytes(b"PK")  # never read: torch is missing
    code = "import sys; sys.modules['torch'] = None; from kiln.cli import main; main()"
    result = subprocess.run(
        [sys.executable, "-c", code, "optimize", "m.pt2", "-o", "x.kiln"],
        cwd=tmp_path, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 2
    assert "needs PyTorch: pip install 'kiln-ml[torch]'" in result.stderr
    assert "torch==2.13.0" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x.kiln").exists()


def test_module_torch_export_rejects_is_one_clear_error(tmp_path):
    out = tmp_path / "x.kiln"
    with pytest.raises(KilnError) as caught:
        kiln.compile(Branchy(), out, example_inputs=(torch.rand(2, 4),), rounds=0)
    message = str(caught.value)
    assert message.startswith("Branchy: torch.export cannot export it")
    assert _line_of(Branchy.forward, "if x.sum()") in message  # where in the user's code
    assert "data-dependent" in message and "\n" not in message
    assert list(tmp_path.iterdir()) == []


def test_example_inputs_are_for_torch_models_only():
    with pytest.raises(KilnError, match="example_inputs and dynamic_shapes are for a PyTorch"):
        kiln.compile("zoo:bert-tiny", example_inputs=(1,), rounds=0)


def test_other_verbs_name_a_pt2_file(tmp_path):
    from kiln.ir import load_model

    (tmp_path / "m.pt2").write_bytes(b"PK")
    with pytest.raises(KilnError, match="saved torch.export program.*kiln optimize"):
        load_model(str(tmp_path / "m.pt2"))


def test_no_example_inputs_says_what_to_give(tmp_path):
    with pytest.raises(KilnError, match="needs example inputs"):
        kiln.compile(_cnn(), tmp_path / "y.kiln", rounds=0)
