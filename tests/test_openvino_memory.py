"""OpenVINO's mapped weights given back once its CPU plugin holds its own copy
(`OpenVinoOptions.release_mapped`), and the pages of its libraries only a compile reads
(`OpenVinoOptions.release_code`): kiln.backends.release."""

from __future__ import annotations

import json
import mmap
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

pytest.importorskip("openvino")

import kiln  # noqa: E402
from kiln.backends import openvino as ovb  # noqa: E402
from kiln.backends import release  # noqa: E402
from kiln.backends.openvino import OpenVinoBackend, OpenVinoOptions  # noqa: E402
from kiln.errors import KilnError  # noqa: E402

LINUX = pytest.mark.skipif(not release.SUPPORTED, reason="madvise release is Linux only")
WIDTH, LAYERS = 2048, 4  # 16 MiB of fp32 weights per layer
F32 = {"inference_precision": "f32"}


def _mlp(width: int = WIDTH, layers: int = LAYERS) -> ir.Model:
    """x[n, width] through `layers` MatMul + Relu, seeded weights (width² fp32 each)."""
    rng = np.random.default_rng(0)
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["n", width]))
    value, nodes, inits = x, [], []
    for i in range(layers):
        array = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        w = ir.Value(name=f"w{i}", const_value=ir.tensor(array, name=f"w{i}"))
        inits.append(w)
        matmul = ir.node("MatMul", [value, w], num_outputs=1)
        relu = ir.node("Relu", matmul.outputs, num_outputs=1)
        for out in (*matmul.outputs, *relu.outputs):
            out.type, out.shape = ir.TensorType(ir.DataType.FLOAT), ir.Shape(["n", width])
        nodes += [matmul, relu]
        value = relu.outputs[0]
    value.name = "y"
    graph = ir.Graph(
        [x], [value], nodes=nodes, initializers=inits, opset_imports={"": 17}, name="mlp"
    )
    return ir.Model(graph, ir_version=8)


@pytest.fixture(scope="module")
def mlp_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mlp") / "mlp.onnx"
    ir.save(_mlp(), path, external_data="mlp.onnx.data")
    return path


def _feeds(n: int = 4) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(1).standard_normal((n, WIDTH)).astype(np.float32)}


def test_bad_values_are_refused_in_one_line():
    with pytest.raises(KilnError, match="OpenVINO option 'release_mapped' must be true or false"):
        OpenVinoOptions(release_mapped="yes").properties()  # type: ignore[arg-type]
    assert OpenVinoOptions().release_mapped is True  # on by default
    with pytest.raises(KilnError, match="OpenVINO option 'release_code' must be true or false"):
        OpenVinoOptions(release_code=1).properties()  # type: ignore[arg-type]
    assert OpenVinoOptions().release_code is True


@LINUX
def test_outputs_are_bit_identical_and_the_state_is_reported(mlp_file):
    on = OpenVinoBackend().compile(str(mlp_file), OpenVinoOptions(**F32))
    off = OpenVinoBackend().compile(str(mlp_file), OpenVinoOptions(**F32, release_mapped=False))
    assert on.settings()["release_mapped"] == "on (1 mapped file)"
    assert off.settings()["release_mapped"] == "off"
    bare = OpenVinoOptions(**F32, release_mapped=False, release_code=False)
    off = OpenVinoBackend().compile(str(mlp_file), bare)
    assert (on.settings()["release_code"], off.settings()["release_code"]) == ("on", "off")
    for n in (4, 4, 7, 4):  # a first run, a steady one, a new shape, the first shape again
        feeds = _feeds(n)
        for got, want in zip(on.run(feeds), off.run(feeds), strict=True):
            assert np.array_equal(got, want)
    # nothing is mapped: weights read (mmap off), or an in-memory model
    no_mmap = OpenVinoBackend().compile(str(mlp_file), OpenVinoOptions(**F32, mmap=False))
    assert no_mmap.settings()["release_mapped"] == "off"
    in_memory = OpenVinoBackend().compile(_mlp(64, 1), OpenVinoOptions(**F32))
    assert in_memory.settings()["release_mapped"] == "off (nothing mapped)"


def test_elsewhere_than_linux_it_is_a_no_op_with_a_note(mlp_file, monkeypatch):
    monkeypatch.setattr(ovb, "RELEASE_SUPPORTED", False)
    monkeypatch.setattr(release, "SUPPORTED", False)
    exe = OpenVinoBackend().compile(str(mlp_file), OpenVinoOptions(**F32))
    assert exe.settings()["release_mapped"] == "off (Linux only)"
    assert release.release_mapped([mlp_file]) == 0
    with release.Releasing([mlp_file]) as releasing:
        assert releasing.paths == []
    exe.run(_feeds())


@LINUX
def test_only_shared_read_only_mappings_are_released(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    with open(path, "r+b") as f:
        shared = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # MAP_SHARED, PROT_READ
        private = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # MAP_PRIVATE, writable
    private[:4] = b"kiln"  # copy-on-write pages: dropping them would lose the write
    assert release.release_mapped([path]) == len(shared)  # the shared mapping only
    assert shared[:8] == bytes(range(8))  # read back from the file, unchanged
    assert private[:4] == b"kiln"
    shared.close()
    private.close()


@LINUX
def test_only_read_only_mappings_under_the_library_folder_are_paged_out(tmp_path):
    library = tmp_path / "libs" / "libengine.so"
    library.parent.mkdir()
    library.write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    other = tmp_path / "weights.bin"
    other.write_bytes(library.read_bytes())
    with open(library, "rb") as lib, open(other, "rb") as data, open(library, "r+b") as rw:
        code = mmap.mmap(lib.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
        written = mmap.mmap(rw.fileno(), 0, access=mmap.ACCESS_COPY)  # rw-p: never advised
        elsewhere = mmap.mmap(data.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    written[:4] = b"kiln"
    assert code[:8] == elsewhere[:8] == bytes(range(8))  # resident
    advised = release.release_code([library.parent])
    if advised == 0:
        pytest.skip("this kernel has no MADV_PAGEOUT")
    assert advised == len(code)  # the private read-only mapping under the folder only
    assert code[:8] == bytes(range(8)) and code[-1] == 255  # read back from the file
    assert written[:4] == b"kiln"
    for mapping in (code, written, elsewhere):
        mapping.close()


def test_the_option_is_recorded_and_reaches_the_engine(tmp_path):
    options = {"release_mapped": False}
    artifact = kiln.compile(_mlp(64, 1), tmp_path / "off.kiln", backend="openvino",
                            engine_options=options, verify=False, rounds=0)  # fmt: skip
    recorded = json.loads((artifact.path / "manifest.json").read_text())
    assert recorded["backend"]["options"]["release_mapped"] is False
    assert recorded["config"]["engine_options"]["release_mapped"] is False
    session = kiln.Session(artifact.path)
    assert session.options["release_mapped"] is False
    assert session.executable.options.release_mapped is False
    session.close()


# A child per setting: the weights' resident pages are the process's own business. It opens a
# 64-wide one-layer model first: what is left above that is the large model's own.
_CHILD = """
import sys, numpy as np
from kiln.backends.openvino import OpenVinoBackend, OpenVinoOptions
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * 4096
backend = OpenVinoBackend(); backend.describe()
options = OpenVinoOptions(inference_precision="f32", release_mapped=sys.argv[3] == "on",
                          release_code=False)
sizes = []
for path, width in ((sys.argv[1], 64), (sys.argv[2], int(sys.argv[4]))):
    before = rss()
    exe = backend.compile(path, options)
    for _ in range(5):
        exe.run({"x": np.ones((4, width), np.float32)})
    sizes.append(rss() - before)
print(*sizes)
"""


def _resident(small: Path, large: Path, setting: str) -> tuple[int, int]:
    """RSS growth (bytes) from opening and running the small model, then the large one."""
    command = [sys.executable, "-c", _CHILD, str(small), str(large), setting, str(WIDTH)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    empty, model = done.stdout.strip().splitlines()[-1].split()
    return int(empty), int(model)


@LINUX
def test_large_weights_read_less_resident_memory_with_it_on(mlp_file, tmp_path):
    small = tmp_path / "small.onnx"
    ir.save(_mlp(64, 1), small, external_data="small.onnx.data")
    weights = sum(v.const_value.nbytes for v in ir.load(str(mlp_file)).graph.initializers.values())
    (empty_off, off), (empty_on, on) = (_resident(small, mlp_file, s) for s in ("off", "on"))
    # Off: OpenVINO's repacked copy and the mapped file both resident, about 2x the weights;
    # on: the copy alone. The mapped copy's pages are what is given back.
    assert off >= 1.75 * weights, (off, weights, empty_off)
    assert off - on >= 0.75 * weights, (off, on, weights)
    assert on <= 1.25 * weights, (on, weights, empty_on)


# A child per setting: the resident pages of OpenVINO's libraries after a compile and 5 runs.
_CODE_CHILD = """
import sys, numpy as np, openvino
from pathlib import Path
from kiln.backends.openvino import OpenVinoBackend, OpenVinoOptions
folder = str(Path(openvino.__file__).resolve().parent)
def library_kib():
    total, inside = 0, False
    for line in open('/proc/self/smaps'):
        fields = line.split()
        if not fields[0].endswith(':'):
            inside = len(fields) > 5 and fields[5].startswith(folder)
        elif fields[0] == 'Rss:' and inside:
            total += int(fields[1])
    return total
options = OpenVinoOptions(inference_precision="f32", release_code=sys.argv[2] == "on")
exe = OpenVinoBackend().compile(sys.argv[1], options)
for n in (4, 4, 4, 4, 4, 7):
    exe.run({"x": np.ones((n, int(sys.argv[3])), np.float32)})
print(library_kib())
"""


@LINUX
def test_library_pages_only_the_compile_read_are_given_back(mlp_file):
    def library_kib(setting: str) -> int:
        command = [sys.executable, "-c", _CODE_CHILD, str(mlp_file), setting, str(WIDTH)]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        return int(done.stdout.split()[-1])

    off, on = library_kib("off"), library_kib("on")
    if on == off:
        pytest.skip("this kernel has no MADV_PAGEOUT")
    # graph transformations and kernel generation: megabytes of code inference never reads
    assert off - on >= 4096, (off, on)


# Chunks under glibc's mmap threshold live in its heap; all freed but the last, the top of the
# heap stays in use, so free() alone cannot give the pages back: only a trim does.
_TRIM_CHILD = """
from kiln.backends.release import trim_heap
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * 4096
chunks = [bytearray(64 * 1024) for _ in range(1600)]  # 100 MiB, each page touched
last = chunks.pop()
del chunks
before = rss()
trimmed = trim_heap()
print(trimmed, before - rss())
"""


@LINUX
def test_a_trimmed_heap_gives_freed_memory_back():
    done = subprocess.run([sys.executable, "-c", _TRIM_CHILD], capture_output=True, text=True,
                          check=True)  # fmt: skip
    trimmed, given_back = done.stdout.split()
    assert trimmed == "True"
    assert int(given_back) >= 64 * 2**20, given_back
