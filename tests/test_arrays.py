"""mtplx.arrays: host reads of MLX arrays with the types the engine knows they have."""

from __future__ import annotations

import mlx.core as mx

from mtplx.arrays import float_list, float_rows, int_list, int_rows, scalar_float, scalar_int


def test_reads_keep_values_and_python_types():
    assert scalar_int(mx.array([7], mx.int32)) == 7 and type(scalar_int(mx.array(7))) is int
    assert scalar_float(mx.array(0.5, mx.float32)) == 0.5
    ids = int_list(mx.array([3, 1, 2], mx.int32))
    assert ids == [3, 1, 2] and all(type(t) is int for t in ids)
    assert float_list(mx.array([0.25, -1.0])) == [0.25, -1.0]
    assert int_rows(mx.array([[1, 2], [3, 4]])) == [[1, 2], [3, 4]]
    assert float_rows(mx.array([[0.5], [1.5]])) == [[0.5], [1.5]]
