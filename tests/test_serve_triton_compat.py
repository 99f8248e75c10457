"""`kiln serve` keeps Triton's promises where an operator's tooling relies on them: the
max_batch_size /config advertises is enforced, statistics count the executions that ran, and
/metrics carries Triton's metric names with their meaning."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.http as triton
from test_serve import RESNET, Server, _start, _stop
from tritonclient.utils import InferenceServerException

MAX_BATCH = 4  # --max-batch of the servers here


@pytest.fixture(scope="module")
def resnet(tmp_path_factory) -> Server:
    home = tmp_path_factory.mktemp("compat-home")
    server = _start(home, f"zoo:{RESNET}", "--max-batch", str(MAX_BATCH))
    yield server
    _stop(server)


def _image(batch: int) -> triton.InferInput:
    data = np.random.default_rng(batch).random((batch, 3, 32, 32), dtype=np.float32)
    tensor = triton.InferInput("input", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data, binary_data=True)
    return tensor


def test_a_request_over_max_batch_size_is_refused_and_memory_stays_bounded(
    resnet: Server,
) -> None:
    client = triton.InferenceServerClient(resnet.url)
    assert client.get_model_config(RESNET)["max_batch_size"] == MAX_BATCH
    client.infer(RESNET, [_image(MAX_BATCH)])  # the largest batch advertised is served
    before = resnet.metric("process_resident_memory_bytes")
    oversized = _image(1000)  # 12 MB: its activations would take hundreds of MB
    for _ in range(20):
        with pytest.raises(InferenceServerException) as refused:
            client.infer(RESNET, [oversized])
        assert refused.value.status() == "400"
        assert f"takes 1 to {MAX_BATCH} per request" in refused.value.message()
    after = resnet.metric("process_resident_memory_bytes")
    assert after <= 1.1 * before, (before, after)
