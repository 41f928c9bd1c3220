"""Shared pytest fixtures.

Tiny checkpoints (``tests/fixtures/checkpoints.py``), built once per test session into a
temporary directory, each a ``pathlib.Path`` to a checkpoint directory that
``mtplx.models.load`` accepts:

- ``llama_mtp_checkpoint``       llama + generic MTP head in ``mtp.safetensors`` (verified)
- ``llama_draft_vocab_checkpoint`` the same with a reduced draft vocabulary (128 tokens)
- ``llama_no_mtp_checkpoint``    llama without MTP weights (no-MTP)
- ``qwen3_next_checkpoint``      Qwen3-Next: gated-delta + attention, MoE, ``mtp.*`` (verified)
- ``qwen3_5_checkpoint``         Qwen3.5 dense, nested text_config, 2 shards + index (verified)
- ``deepseek_v3_checkpoint``     DeepSeek-V3: MLA, MoE, ``model.layers.2.*`` MTP (verified)
- ``deepseek_v4_checkpoint``     mlx-lm deepseek_v41 + ``mtp.0.*`` (arch-compatible-unverified)
- ``unsupported_checkpoint``     a model_type mlx-lm does not know (unsupported)

All share one tokenizer (259 tokens: 256 bytes + <|endoftext|>=256, <|im_start|>=257,
<|im_end|>=258; ChatML template), hidden size 64, float32 weights, seed 0. Treat the
directories as read-only: copy one (``shutil.copytree``) before changing it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

# ``import mtplx`` must come before anything imports ``mlx.core``: it routes libmlx's BLAS to
# OpenBLAS (mtplx.blas), which only works before libmlx is loaded. Conftest files are imported
# before test modules, so doing it here covers test modules that import mlx first.
import mtplx  # noqa: F401
from mtplx.file_limits import import_mlx_lm

# As the command line does: mlx-lm would otherwise cap this process's (and every live
# server's it starts) open-file limits at (2048, 4096).
import_mlx_lm()

from tests.fixtures.checkpoints import build_checkpoint  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def calibration_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The session's calibration cache (``MTPLX_CALIBRATION_DIR``, inherited by the live
    servers the tests start), not the user's: the checkpoints are built anew every session
    and a calibration's key holds their path and times, so what a session calibrates is
    never read again. The kernels and the converted default model stay shared under
    ``MTPLX_HOME``, built once."""
    directory = tmp_path_factory.mktemp("calibration")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MTPLX_CALIBRATION_DIR", str(directory))
        yield directory


def _build(factory: pytest.TempPathFactory, kind: str, **options: object) -> Path:
    return build_checkpoint(kind, factory.mktemp(kind), **options)


@pytest.fixture(scope="session")
def llama_mtp_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory, "llama_mtp")


@pytest.fixture(scope="session")
def llama_draft_vocab_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory, "llama_mtp", draft_vocab=128)


@pytest.fixture(scope="session")
def llama_no_mtp_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory, "llama_no_mtp")


@pytest.fixture(scope="session")
def qwen3_next_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory, "qwen3_next")


@pytest.fixture(scope="session")
def qwen3_5_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory, "qwen3_5")


@pytest.fixture(scope="session")
def deepseek_v3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory, "deepseek_v3")


@pytest.fixture(scope="session")
def deepseek_v4_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory, "deepseek_v4")


@pytest.fixture(scope="session")
def unsupported_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory, "unsupported")
