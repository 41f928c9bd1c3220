"""MTPLX: exact speculative decoding on MLX behind an OpenAI-compatible server."""

# Before anything can import mlx: on Linux, point libmlx's BLAS/LAPACK imports at OpenBLAS
# (see mtplx.blas). Never raises; MTPLX_BLAS=reference opts out.
from mtplx.blas import enable_fast_blas as _enable_fast_blas

_enable_fast_blas()

__version__ = "0.1.0"
