"""The step profiler (kiln.train.profiling): a tiny Linear stack trained by a minimal loop that
marks its phases as Kiln's loop does, profiled with and without a planted slow dataset."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from html.parser import HTMLParser

import pytest

torch = pytest.importorskip("torch")

from markupsafe import escape  # noqa: E402
from rich.console import Console  # noqa: E402
from torch import nn  # noqa: E402

from kiln.hardware import Peaks  # noqa: E402
from kiln.train.config import TrainConfig  # noqa: E402
from kiln.train.phases import PHASES, phase  # noqa: E402
from kiln.train.profiling import (  # noqa: E402
    PARTS,
    UNTRIED,
    Finding,
    diagnose,
    print_profile,
    profile_steps,
    try_advice,
    write_report,
)
from kiln.train.profiling.trace import _communication, _Event, _windows  # noqa: E402

# Peaks given, not measured: measuring takes ~15 s; the MFU arithmetic is what is tested.
PEAKS = Peaks(100.0, 300.0, 400.0, 20.0, 2, "2026-01-01T00:00:00+00:00")
BATCH, WIDTHS = 32, (256, 512, 512, 10)
SLOW_SAMPLE_S = 0.005  # the planted slowness: 5 ms per sample, 160 ms per batch


class Samples(torch.utils.data.Dataset):
    """Random (input, class) pairs, each taking `sleep` seconds to fetch."""

    def __init__(self, count: int, sleep: float = 0.0) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(count, WIDTHS[0], generator=generator)
        self.y = torch.randint(0, WIDTHS[-1], (count,), generator=generator)
        self.sleep = sleep

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sleep:
            time.sleep(self.sleep)
        return self.x[index], self.y[index]


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for n_in, n_out in zip(WIDTHS, WIDTHS[1:], strict=False):
        layers += [nn.Linear(n_in, n_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def expected_flops(stack: nn.Sequential) -> int:
    """2·B·in·out per Linear forward; backward the weight's gradient for every layer and the
    input's for all but the first (the batch needs no gradient). Adam's updates are not
    matmuls: FlopCounterMode counts none of them."""
    linears = [m for m in stack if isinstance(m, nn.Linear)]
    forward = [2 * BATCH * m.in_features * m.out_features for m in linears]
    return 3 * sum(forward) - forward[0]


def make_step(model: nn.Module, dataset: Samples) -> Callable[[], None]:
    """One optimizer step of a plain loop, phases marked as kiln.train's loop marks them."""
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    stream = _forever(loader)

    def step() -> None:
        with phase("data"):
            inputs, targets = next(stream)
        with phase("forward"):
            loss = nn.functional.cross_entropy(model(inputs), targets)
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad()

    return step


def _forever(loader: torch.utils.data.DataLoader) -> Iterator[tuple[torch.Tensor, ...]]:
    while True:
        yield from loader


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    # Two cores shared with other work: OpenMP threads spinning against other processes
    # make a step 30× slower and its split noise. One thread measures the loop, not that.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def fast() -> tuple:
    model = make_model()
    profile = profile_steps(make_step(model, Samples(8 * BATCH)), model=model, peaks=PEAKS,
                            samples_per_step=BATCH)  # fmt: skip
    return model, profile


@pytest.fixture(scope="module")
def slow() -> tuple:
    model = make_model()
    step = make_step(model, Samples(4 * BATCH, sleep=SLOW_SAMPLE_S))
    return model, profile_steps(step, model=model, steps=3, warmup=1, peaks=PEAKS)


def test_split_adds_up_to_the_step_and_every_phase_is_measured(fast) -> None:
    _, profile = fast
    assert len(profile.steps) == 5
    for step in profile.steps:
        assert sum(step[part] for part in PARTS) == pytest.approx(step["step_ms"], rel=1e-9)
        assert all(step[name] > 0 for name in PHASES), step
        # the loop does all its work inside phases: what they measured is the step, within 10 %
        measured = sum(step[name] for name in (*PHASES, "communication"))
        assert measured >= 0.9 * step["step_ms"], step
    assert sum(profile.split_ms.values()) == pytest.approx(profile.step_ms, rel=1e-9)
    assert profile.communication["collectives"] == {}  # one process: nothing to wait for


def test_memory_timeline_has_the_optimizer_state_of_adam(fast) -> None:
    model, profile = fast
    memory = profile.memory
    assert memory["source"] == "categories", memory["note"]
    assert memory["peak_mib"] == pytest.approx(sum(memory["at_peak_mib"].values()))
    # Adam keeps two moments per parameter (its step counters are a few bytes)
    params_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    assert memory["at_peak_mib"]["optimizer state"] == pytest.approx(2 * params_mib, rel=0.01)


def test_planted_slow_dataset_is_data_bound_and_the_fast_one_is_not(slow, fast) -> None:
    found = {f.kind: f for f in diagnose(slow[1])}
    assert "data-bound" in found, [f.title for f in found.values()]
    advice = found["data-bound"]
    assert "loader.workers" in advice.settings and '"workers"' in advice.action
    assert advice.settings["loader.workers"] >= 1
    assert "data-bound" not in {f.kind for f in diagnose(fast[1])}
    for finding in [*found.values(), *diagnose(fast[1])]:  # every fix is a valid TrainConfig
        TrainConfig().replace(**finding.changes())


def test_flops_match_the_linear_stack_and_mfu_is_printed(fast) -> None:
    model, profile = fast
    assert profile.flops_per_step == pytest.approx(expected_flops(model), rel=0.03)
    assert profile.mfu is not None and 0 < profile.mfu < 1
    assert profile.peak_precision == "fp32" and profile.peak_gflops == PEAKS.fp32_gflops
    console = Console(record=True, width=200)
    print_profile(profile, diagnose(profile), console)
    assert f"{profile.mfu:.1%}" in console.export_text()


def test_report_is_self_contained_and_shows_the_findings(slow, tmp_path) -> None:
    _, profile = slow
    findings = diagnose(profile)
    path = write_report(profile, findings, tmp_path / "report.html")
    text = path.read_text()
    assert _loads(text) == []  # plotly.js is inline; nothing is fetched
    assert "Plotly.newPlot" in text and 'id="split"' in text and 'id="memory"' in text
    for finding in findings:
        assert str(escape(finding.title)) in text and str(escape(finding.action)) in text
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]  # no temporary left


def _loads(text: str) -> list[str]:
    """What a browser would fetch to show the page: src and href of the tags that load."""
    found: list[str] = []

    class Links(HTMLParser):
        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            values = dict(attrs)
            link = values.get("href") if tag == "link" else values.get("src")
            if link and tag in {"script", "img", "iframe", "embed", "source", "link"}:
                found.append(link)

    Links().feed(text)
    return found


def test_exposed_communication_is_what_no_compute_overlaps() -> None:
    # one step 0–100 µs: backward 10–60, optimizer 60–90; a gloo all-reduce 20–80 on its own
    # thread, compute 10–40 and 70–75 on the main thread: exposed 40–60 in backward, 60–70 and
    # 75–80 in optimizer
    events = [
        _Event("kiln.step", 0, 100, 1, False, ()),
        _Event("kiln.backward", 10, 60, 1, False, ()),
        _Event("kiln.optimizer", 60, 90, 1, False, ()),
        _Event("aten::mm", 10, 40, 1, False, ("float",)),
        _Event("aten::add_", 70, 75, 1, False, ("float",)),
        _Event("gloo:all_reduce", 20, 80, 7, False, ()),
        _Event("aten::copy_", 30, 50, 7, False, ("float",)),  # the collective's own copy
    ]
    comm = _communication(events, _windows(events))
    assert comm["exposed_ms"] == pytest.approx(0.035)
    assert comm["overlapped_ms"] == pytest.approx(0.025)
    assert comm["by_phase_ms"]["backward"] == pytest.approx(0.020)
    assert comm["by_phase_ms"]["optimizer"] == pytest.approx(0.015)
    assert comm["collectives"] == {"gloo:all_reduce": 1}


def test_ddp_gradient_all_reduce_is_found(tmp_path) -> None:
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = nn.parallel.DistributedDataParallel(make_model())
        step = make_step(model, Samples(4 * BATCH))
        profile = profile_steps(step, model=model, steps=2, warmup=1, peaks=PEAKS)
    finally:
        dist.destroy_process_group()
    assert "gloo:all_reduce" in profile.communication["collectives"]
    assert profile.flops_per_step == pytest.approx(expected_flops(model.module), rel=0.03)
    assert sum(profile.split_ms.values()) == pytest.approx(profile.step_ms, rel=1e-9)


def _with_memory(profile, peak_mib: float, device_mib: float):
    """The profile with its peak memory held mostly by activations, on a device this large."""
    import dataclasses

    shares = {"parameters": 0.05, "gradients": 0.05, "optimizer state": 0.1, "activations": 0.8}
    held = {**{k: v * peak_mib for k, v in shares.items()}, "other": 0.0}
    memory = {**profile.memory, "source": "categories", "peak_mib": peak_mib,
              "at_peak_mib": held, "device_mib": device_mib, "device": "cpu"}  # fmt: skip
    return dataclasses.replace(profile, memory=memory)


def test_activation_checkpointing_is_advised_only_where_memory_is_the_constraint(fast) -> None:
    # activations hold 80 % of the peak in both; only the second is short of memory
    roomy = _with_memory(fast[1], peak_mib=64, device_mib=24 * 1024)
    tight = _with_memory(fast[1], peak_mib=20 * 1024, device_mib=24 * 1024)
    assert "memory-activations" not in {f.kind for f in diagnose(roomy)}
    advice = {f.kind: f for f in diagnose(tight)}["memory-activations"]
    assert advice.settings == {"checkpointing.policy": "full"}


def _finding(kind: str, settings: dict) -> Finding:
    return Finding(kind, kind, 0.5, 10.0, "evidence", "fix: kiln train …", settings=settings)


def _sleeping(seconds: float) -> Callable[[], None]:
    return lambda: time.sleep(seconds)  # a planted step time, as the slow dataset plants its own


def test_speed_advice_is_measured_and_withdrawn_where_it_is_not_faster() -> None:
    now = _sleeping(0.004)
    steps = {"bf16": _sleeping(0.012), "fp16": _sleeping(0.001)}  # one slower, one faster
    findings = [
        _finding("slower", {"precision": "bf16"}),
        _finding("faster", {"precision": "fp16"}),
        _finding("untestable", {"loader.workers": 2}),
    ]
    memory = Finding(
        "memory", "memory", 0.9, None, "evidence", "fix", settings={"checkpointing.policy": "full"}
    )

    tried = try_advice([*findings, memory], now, lambda c: steps.get(c.get("precision")),
                       make_model())  # fmt: skip
    by_kind = {f.kind: f for f in tried}
    assert by_kind["slower"].measured["verdict"] == "slower"
    assert by_kind["slower"].action.startswith("keep the settings in use")
    assert (
        by_kind["faster"].measured["verdict"] == "faster"
        and "measured here" in by_kind["faster"].action
    )
    assert by_kind["untestable"].measured == {"tried": False, "why": UNTRIED}
    assert "untested" in by_kind["untestable"].action
    assert by_kind["memory"].measured is None  # a memory finding is not a speed claim
    assert tried[-1].kind == "slower"  # withdrawn advice comes after every standing one


def test_the_loop_switches_only_the_precision_between_steps() -> None:
    from kiln.train.prepared import prepare
    from kiln.train.profiling.job import advised_step

    model = make_model()
    prepared = prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), TrainConfig(micro_batch=BATCH)
    )
    dtypes: list[torch.dtype] = []

    def one_step() -> None:
        with prepared.autocast():
            dtypes.append(prepared.model(torch.randn(BATCH, WIDTHS[0])).dtype)

    advised = advised_step(prepared, one_step)
    assert advised({"loader": {"workers": 2}}) is None  # another run's setting
    assert advised({"precision": "fp16"}) is None  # needs a loss scaler this run may not have
    advised({"precision": "bf16"})()
    one_step()
    assert dtypes == [torch.bfloat16, torch.float32]  # the run's own precision is back
    assert prepared.config.precision == "fp32"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "pipeline"])
def test_profile_on_two_ranks_keeps_the_training_and_sees_their_communication(
    strategy: str, tmp_path
) -> None:
    import json
    import subprocess
    import sys

    (tmp_path / "tiny.py").write_text(TINY)
    command = [sys.executable, "-m", "kiln", "train", "tiny:model", "--data", "tiny:data",
               "--batch", "16", "--steps", "3", "--nproc", "2", "--strategy", strategy,
               "--profile", "report.html", "-o", "record.json"]  # fmt: skip
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "CPUAllocator" not in done.stderr and "USDT" not in done.stderr, done.stderr[-2000:]
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["steps"] == 3 and len(record["loss"]) == 3  # the training's record is whole
    profile = record["profile"]
    assert profile.get("error") is None and (tmp_path / "report.html").stat().st_size > 0
    assert profile["communication"]["collectives"], profile["communication"]
    # the job's FLOPs, every rank's share summed: what one process counts for the global batch
    assert profile["flops_per_step"] == pytest.approx(TINY_FLOPS, rel=0.03)


# Linear(32, 64) and Linear(64, 4) on 16 samples: 2·B·in·out forward each; backward both
# weights' gradients and the second layer's input gradient (the batch needs none).
TINY_FLOPS = 3 * 2 * 16 * (32 * 64 + 64 * 4) - 2 * 16 * 32 * 64


TINY = """
import torch
from torch import nn


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))


def data():
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(64, 32, generator=g),
                                          torch.randint(0, 4, (64,), generator=g))
"""


def test_the_profiler_leaves_no_native_lines_on_stderr(capfd) -> None:
    model = make_model()
    profile_steps(make_step(model, Samples(2 * BATCH)), model=model, steps=1, warmup=0,
                  count_flops=False, peaks=PEAKS)  # fmt: skip
    err = capfd.readouterr().err
    assert "USDT" not in err and "CPUAllocator" not in err, err
