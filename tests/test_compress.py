"""kiln.compress: every method ends in a verified artifact whose costs moved the right way;
bad input is one clear line with nothing written. Tiny models and few images: these check
behaviour, benchmarks/compress.py measures the real figures."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from kiln.artifact import read_artifact  # noqa: E402
from kiln.compress import Result, Row, compress  # noqa: E402
from kiln.compress.api import fastest_within_budget  # noqa: E402
from kiln.compress.data import Dataset, Split, digits  # noqa: E402
from kiln.compress.models import DigitsCNN, PatchTransformer  # noqa: E402
from kiln.compress.train import Recipe  # noqa: E402
from kiln.errors import KilnError  # noqa: E402

QUICK = {"recipe": Recipe(epochs=1), "rounds": 1, "runs": 1}
TINY_MODELS = textwrap.dedent(
    """
    from kiln.compress.data import digits as full
    from kiln.compress.models import DigitsCNN, PatchTransformer

    def cnn():
        return DigitsCNN((4, 8, 8), convs=1)

    def data():
        return full().subset(128, 64, 64)

    def small_images():
        d = data()
        shrink = lambda s: type(s)(s.x[:, :, ::4, ::4].contiguous(), s.y)
        return type(d)(d.name, shrink(d.train), shrink(d.val), shrink(d.test), d.classes)

    def transformer():
        return PatchTransformer(dim=16, depth=1, heads=2)

    def cnn_of(width):
        return DigitsCNN((width, 8, 8), convs=1)
    """
)


@pytest.fixture(scope="module")
def data() -> Dataset:
    return digits().subset(128, 64, 64)


def tiny_cnn() -> DigitsCNN:
    return DigitsCNN((4, 8, 8), convs=1)


@pytest.mark.slow  # ≈ 80 s on a loaded 2-core host: six trainings and compiles
def test_every_method_yields_a_verified_artifact_with_the_right_costs(tmp_path, data):
    result = compress(tiny_cnn, data, method="all", amount=0.5, max_drop=0.99,
                      workdir=tmp_path, **QUICK)  # fmt: skip
    rows = {r.method: r for r in result.rows}
    assert set(rows) == {"fp32", "int8-ptq", "qat", "prune", "distill", "combined"}
    for row in rows.values():
        manifest = read_artifact(row.artifact).manifest
        assert manifest.verification.ok, row.method
        assert manifest.precision["default"] == row.precision
        assert 0.0 <= row.accuracy <= 1.0 and row.p50_ms > 0
    base = rows["fp32"]
    for smaller in ("prune", "distill", "combined"):
        assert rows[smaller].params < base.params and rows[smaller].flops < base.flops, smaller
    qat_plan = read_artifact(rows["qat"].artifact).manifest.precision
    assert qat_plan["scheme"] == "QDQ given in the model"  # kept, not quantized again
    assert rows["prune"].detail["amount"] == 0.5


@pytest.mark.slow
def test_pruning_a_transformer_removes_heads_and_neurons(tmp_path, data):
    def make():
        return PatchTransformer(dim=16, depth=1, heads=2)

    result = compress(make, data, method="prune", amount=0.5, max_drop=0.99, workdir=tmp_path,
                      **QUICK)  # fmt: skip
    base, pruned = result.row("fp32"), result.row("prune")
    assert pruned.params < base.params and pruned.flops < base.flops
    assert read_artifact(pruned.artifact).manifest.verification.ok


class Branchy(torch.nn.Module):
    """Data-dependent control flow: torch.export refuses it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(32 * 32, 10)

    def forward(self, x):
        flat = x.flatten(1)
        if flat.sum() > 0:
            return self.linear(flat)
        return -self.linear(flat)


def test_a_module_that_does_not_export_is_named_before_training(tmp_path, data):
    out = tmp_path / "out.kiln"
    with pytest.raises(KilnError, match=r"Branchy: .*data-dependent") as error:
        compress(Branchy(), data, out, method="distill", **QUICK)
    assert "\n" not in str(error.value)
    assert not out.exists()


def test_data_of_the_wrong_shape_names_expected_and_got(tmp_path, data):
    def shrink(s: Split) -> Split:
        return Split(s.x[:, :, ::4, ::4].contiguous(), s.y)

    small = Dataset("small", shrink(data.train), shrink(data.val), shrink(data.test), 10)
    out = tmp_path / "out.kiln"
    with pytest.raises(KilnError, match=r"\(N, 1, 8, 8\).*expects \(N, 1, 32, 32\)"):
        compress(PatchTransformer(dim=16, depth=1, heads=2), small, out, **QUICK)
    bad_labels = Dataset("labels", Split(data.train.x, data.train.y.float()), data.val,
                         data.test, 10)  # fmt: skip
    with pytest.raises(KilnError, match=r"expected labels of shape \(N,\) int64.*got"):
        compress(tiny_cnn(), bad_labels, out, **QUICK)
    assert not out.exists()


def test_a_budget_no_pruning_level_meets_is_refused(tmp_path, data, monkeypatch):
    import kiln.compress.api as api

    scores = iter([1.0])  # the fp32 model is perfect; every pruned level then loses 50 pt
    monkeypatch.setattr(api, "accuracy", lambda _model, _split: next(scores, 0.5))
    out = tmp_path / "out.kiln"
    with pytest.raises(KilnError, match="no pruning level meets --max-drop 0.01") as error:
        compress(tiny_cnn, data, out, method="prune", train=False, **QUICK)
    assert str(error.value).count("loses 50.0 pt") == len(api.LEVELS)
    assert not out.exists()


def kiln(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kiln", *args], cwd=cwd, capture_output=True, text=True
    )


def test_cli_json_and_bad_data(tmp_path):
    (tmp_path / "tiny.py").write_text(TINY_MODELS)
    args = ["--method", "distill", "--epochs", "1", "--max-drop", "0.99", "-o", "out.kiln"]
    done = kiln("compress", "tiny:cnn", "--data", "tiny:data", *args, "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert set(result["methods"]) == {"fp32", "distill"}
    rows = result["methods"]
    fastest = min(rows, key=lambda name: rows[name]["p50_ms"])  # both within --max-drop 0.99
    assert result["chosen"] == fastest and read_artifact(tmp_path / "out.kiln").manifest
    for row in rows.values():
        assert {"accuracy", "p50_ms", "params", "flops", "artifact"} <= set(row)
    # every path the JSON names is there after the command (the temporary ones are not named)
    assert rows[fastest]["artifact"] == result["output"] == "out.kiln"  # as given, in cwd
    assert [row["artifact"] for name, row in rows.items() if name != fastest] == [None]
    bad = kiln("compress", "tiny:transformer", "--data", "tiny:small_images", "-o", "bad.kiln",
               cwd=tmp_path)  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "(N, 1, 8, 8)" in bad.stderr
    assert not (tmp_path / "bad.kiln").exists()
    needy = kiln("compress", "tiny:cnn_of", "--data", "tiny:data", "-o", "bad.kiln",
                 cwd=tmp_path)  # fmt: skip
    assert needy.returncode == 2, needy.stderr  # the user's factory, not a bug in Kiln
    assert needy.stderr.strip().count("\n") == 0
    assert "model factory tiny:cnn_of(width) needs arguments" in needy.stderr
    assert not (tmp_path / "bad.kiln").exists()


class NotBuiltIn(torch.nn.Module):
    """A user's own CNN: Kiln has no built-in student for it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3, stride=4)
        self.head = torch.nn.Linear(4, 10)

    def forward(self, x):
        return self.head(self.conv(x).mean(dim=(2, 3)))


@pytest.fixture
def no_training(monkeypatch):
    """Training (or distilling, or QAT) fails the test: errors must come before any."""
    import kiln.compress.api as api

    def refuse(*_args, **_kwargs):
        raise AssertionError("trained before the error")

    for name in ("fit", "distill", "qat"):
        monkeypatch.setattr(api, name, refuse)


def needs_width(width: int) -> DigitsCNN:
    return DigitsCNN((width, 8, 8), convs=1)


def not_a_module() -> dict:
    return {"conv": 1}


def needs_a_path(path: str) -> Dataset:
    raise AssertionError("never called")


def wrong_classes() -> DigitsCNN:
    return DigitsCNN((2, 4, 4), convs=1, classes=3)


@pytest.mark.parametrize(
    ("model", "loader", "student", "message"),
    [
        (needs_width, None, None, r"model factory .*:needs_width\(width\) needs arguments"),
        (not_a_module, None, None, r"model factory .*:not_a_module returned a dict; expected a "
         r"torch.nn.Module"),
        (tiny_cnn, needs_a_path, None, r"data loader .*:needs_a_path\(path\) needs "
         r"arguments"),
        (tiny_cnn, None, needs_width, r"student factory .*:needs_width\(width\) needs"),
        (tiny_cnn, None, not_a_module, r"student factory .*:not_a_module returned a dict"),
        (tiny_cnn, None, wrong_classes, r"the student: DigitsCNN returns \(2, 3\).*10 classes"),
    ],
)  # fmt: skip
def test_the_users_own_functions_are_named_before_training(
    tmp_path, data, no_training, model, loader, student, message
):
    out = tmp_path / "out.kiln"
    with pytest.raises(KilnError, match=message) as error:
        compress(model, loader or data, out, method="distill", student=student, **QUICK)
    assert "\n" not in str(error.value)
    assert not out.exists()


def test_distill_without_a_student_is_refused_before_training(tmp_path, data, no_training):
    out = tmp_path / "out.kiln"
    with pytest.raises(KilnError, match="no built-in student for NotBuiltIn: give one with"):
        compress(NotBuiltIn(), data, out, method="distill", **QUICK)
    assert not out.exists()


def test_all_without_a_student_skips_distillation_saying_why(data):
    import kiln.compress.api as api

    student, why = api._student(NotBuiltIn(), None, "all", data)  # decided before training
    assert student is None and "no built-in student for NotBuiltIn" in why
    student, why = api._student(tiny_cnn(), None, "all", data)
    assert isinstance(student, DigitsCNN) and why is None


def _row(method: str, accuracy: float, p50_ms: float) -> Row:
    return Row(method, "fp32", accuracy, accuracy, 1, 1, f"{method}.kiln", p50_ms)


def test_the_uncompressed_model_wins_when_compression_made_it_slower():
    # the figures: fp32 0.50 ms, QAT 1.04 ms, both 100 % accurate
    rows = [_row("fp32", 1.0, 0.50), _row("int8-ptq", 1.0, 0.90), _row("qat", 1.0, 1.04)]
    result = Result("SmallCNN", "digits", 64, "accuracy", 0.01, rows)
    assert fastest_within_budget(result).method == "fp32"
    rows.append(_row("prune", 0.995, 0.30))  # faster and within the budget: it wins
    assert fastest_within_budget(result).method == "prune"
    rows.append(_row("distill", 0.9, 0.10))  # faster still, but loses 10 pt
    assert fastest_within_budget(result).method == "prune"


@pytest.mark.parametrize(
    ("features", "saturates"),
    [(["avx2", "fma"], True), (["avx2", "avx512_vnni"], False), (["avx2", "avx_vnni"], False),
     (["avx2", "amx_int8"], False), (["asimd"], False)],
)  # fmt: skip
def test_7_bit_weights_exactly_where_int8_dot_products_saturate(features, saturates):
    from dataclasses import replace

    from kiln.hardware import cpu_info

    assert replace(cpu_info(), features=features).int8_dot_saturates is saturates


def test_qat_artifact_computes_what_the_trained_model_does(tmp_path, data, monkeypatch):
    """7-bit weights survive the export (ONNX QuantizeLinear knows only 8-bit ranges) and
    the int8 artifact's logits are the QAT model's; full-range weights lost 5–33 points on an
    AVX2 host without VNNI, where ONNX Runtime's int8 kernels saturate."""
    from dataclasses import replace

    import numpy as np

    from kiln.compress import artifact as art
    from kiln.compress import qat as qat_module
    from kiln.hardware import cpu_info

    narrow = replace(cpu_info(), features=["avx2", "fma"])
    monkeypatch.setattr(qat_module, "cpu_info", lambda: narrow)
    model = tiny_cnn()
    quantized = qat_module.qat(model, data, Recipe(epochs=1))
    frozen = [m for m in quantized.modules() if isinstance(m, qat_module.FrozenFakeQuant)]
    weights = [m for m in frozen if m.per_channel]
    assert weights and all(m.narrow for m in weights)
    for fake in weights:  # what the export quantizes: clamped, then 8-bit QuantizeLinear
        wide = torch.randn(len(fake.scale), 3, 3, 3) * 10
        codes = torch.round(fake(wide) / fake.scale.reshape(-1, 1, 1, 1))
        assert codes.min() >= -64 and codes.max() <= 63
    built = art.build(quantized, tmp_path / "qat.kiln", data, precision="int8")
    session = art.session_at(built.artifact.path)
    x = data.test.x[: art.BATCH]
    x = torch.cat([x, data.val.x[: art.BATCH - len(x)]]) if len(x) < art.BATCH else x
    got = session.run(None, {session.input_names[0]: x.numpy()})[0]
    with torch.no_grad():
        want = quantized(x).numpy()
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.95
