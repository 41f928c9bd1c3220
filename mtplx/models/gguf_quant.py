"""Repack GGUF's simple block quantizations as MLX affine quantization, losslessly.

Q4_0, Q4_1 and Q8_0 blocks are 32 weights sharing a float16 scale ``d`` (and, for Q4_1,
a minimum ``m``): ``w = d * q + m``. That is exactly MLX's affine form
``w = scale * q + bias`` with ``group_size=32``, so these tensors can stay quantized with no
rounding at all:

- Q4_1: ``q`` in 0..15, ``scale = d``, ``bias = m``
- Q4_0: ``q - 8`` with ``q`` in 0..15, ``scale = d``, ``bias = -8 d``
- Q8_0: signed ``q``; stored as ``q + 128`` with ``scale = d``, ``bias = -128 d``

Only the nibble order differs: a GGUF 4-bit block keeps element ``j`` in the low nibble of
byte ``j`` and element ``j + 16`` in its high nibble, while MLX packs consecutive elements
low-nibble first into little-endian uint32 words. K-quants (Q4_K, ...) use nested scales
that MLX cannot express; the caller dequantizes those.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

__all__ = ["GROUP_SIZE", "MLX_BITS", "to_mlx_affine"]

GROUP_SIZE = 32
MLX_BITS = {
    GGMLQuantizationType.Q4_0: 4,
    GGMLQuantizationType.Q4_1: 4,
    GGMLQuantizationType.Q8_0: 8,
}


def to_mlx_affine(
    raw: np.ndarray, qtype: GGMLQuantizationType, rows: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``(weight uint32, scales f32, biases f32)`` for ``mx.dequantize``, or ``None``.

    ``raw`` is the tensor's bytes as the ``gguf`` reader gives them (one row of blocks per
    output row); ``None`` means the type has no lossless MLX form.
    """
    if qtype not in MLX_BITS:
        return None
    # Annotated wide: the byte view changes rank as it is split into blocks.
    blocks: np.ndarray = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, -1)
    if qtype == GGMLQuantizationType.Q8_0:
        blocks = blocks.reshape(rows, -1, 2 + 32)
        d = _f16(blocks[..., :2])
        q = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        scales, biases = d, -128.0 * d
        packed: np.ndarray = q.reshape(rows, -1)  # one byte per weight already in order
    else:
        head = 4 if qtype == GGMLQuantizationType.Q4_1 else 2
        blocks = blocks.reshape(rows, -1, head + 16)
        d = _f16(blocks[..., :2])
        biases = _f16(blocks[..., 2:4]) if head == 4 else -8.0 * d
        scales = d
        qs = blocks[..., head:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # elements 0..15, then 16..31
        packed = (q[..., 0::2] | (q[..., 1::2] << 4)).reshape(rows, -1)
    weight = np.ascontiguousarray(packed).view("<u4")
    return weight, scales.astype(np.float32), biases.astype(np.float32)


def _f16(two_bytes: np.ndarray) -> np.ndarray:
    """Little-endian float16 from the last axis of 2 bytes; shape drops that axis."""
    return np.ascontiguousarray(two_bytes).view("<f2")[..., 0].astype(np.float32)
