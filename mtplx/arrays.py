"""Reading MLX arrays on the host with the types the engine knows they have.

MLX's stubs type ``array.item()`` as any scalar (int, float or complex) and
``array.tolist()`` as a scalar or nested lists, whatever the dtype; these helpers state the
type a caller's integer array has, so the type checker can follow the values.
"""

from __future__ import annotations

from typing import cast

import mlx.core as mx

__all__ = ["float_list", "float_rows", "int_list", "int_rows", "scalar_float", "scalar_int"]


def scalar_int(value: mx.array) -> int:
    """A one-element integer array's value (reading it waits for its computation)."""
    return int(cast(int, value.item()))


def scalar_float(value: mx.array) -> float:
    """A one-element floating array's value."""
    return float(cast(float, value.item()))


def int_list(value: mx.array) -> list[int]:
    """A one-dimensional integer array's values."""
    return [int(t) for t in cast(list[int], value.tolist())]


def float_list(value: mx.array) -> list[float]:
    """A one-dimensional floating array's values."""
    return cast(list[float], value.tolist())


def int_rows(value: mx.array) -> list[list[int]]:
    """A two-dimensional integer array's rows."""
    return cast(list[list[int]], value.tolist())


def float_rows(value: mx.array) -> list[list[float]]:
    """A two-dimensional floating array's rows."""
    return cast(list[list[float]], value.tolist())
