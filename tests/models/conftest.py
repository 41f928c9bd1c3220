"""Fixtures of the model tests: the llama fixture checkpoint, float32 and quantized."""

from __future__ import annotations

import pytest

from mtplx.models import load
from tests.fixtures.checkpoints import build_checkpoint
from tests.fixtures.variants import quantize_checkpoint, untie_lm_head


@pytest.fixture(scope="module", params=["float32", "q4", "q4-int8"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The llama fixture in float32, and quantized (4-bit affine: its products on the
    invariant quantized kernel, with float32 or int8 activations: MTPLX_ACTIVATIONS is a
    process setting, held for the module's tests of that model)."""
    directory = tmp_path_factory.mktemp("batched")
    build_checkpoint("llama_mtp", directory)
    untie_lm_head(directory)
    quantized = request.param.startswith("q4")
    if quantized:
        quantize_checkpoint(directory, bits=4, group_size=32)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MTPLX_ACTIVATIONS", "int8" if request.param == "q4-int8" else "float32")
        loaded = load(directory)
        assert loaded.weights.startswith("affine q4" if quantized else "float32")
        yield loaded
