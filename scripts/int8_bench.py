"""The quantized products of the default model: float mode, integer-dot mode, and optionally
the integer-dot mode of another revision of the kernel.

Each product shape of SmolLM2-135M (qkv, o, gate/up, down: 4-bit group 32; the tied LM
head: 8-bit group 32; float16 scales and biases as the GGUF's) at 1, 2, 4, 16 and 512 rows,
every mode called through its C entry (``mtplx_qmm``, ``mtplx_qmm_int8``) on one thread,
A/B interleaved in one process; CPU time of the calling thread (``time.thread_time``),
median of repeats. Prints a markdown table and the load average before and after.

    python scripts/int8_bench.py [--repeats 7] [--baseline REV]

``--baseline REV`` compiles ``mtplx/quant_kernel.c`` as it was at git revision REV (with
this CPU's variant flags, as a plain shared library) and adds its int8 entry as a column.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

import mtplx  # noqa: F401  (enables the BLAS shim before MLX loads)
from mtplx import quant

# (name, N, K, bits): one layer's products and the LM head.
SHAPES = [
    ("qkv 960x576", 960, 576, 4),
    ("o 576x576", 576, 576, 4),
    ("gate/up 3072x576", 3072, 576, 4),
    ("down 576x1536", 576, 1536, 4),
    ("LM head 49152x576 (8-bit)", 49152, 576, 8),
]
ROWS = (1, 2, 4, 16, 512)
GROUP = 32
ROOT = Path(__file__).resolve().parent.parent


def _weights(n: int, k: int, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    import mlx.core as mx  # after mtplx: the BLAS shim comes first

    rng = np.random.default_rng(n + k + bits)
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
    packed, scales, biases = mx.quantize(w, group_size=GROUP, bits=bits)
    return (
        np.array(packed),
        np.array(scales.astype(mx.float16)).view(np.uint16),
        np.array(biases.astype(mx.float16)).view(np.uint16),
    )


def _baseline(rev: str, out: Path) -> ctypes.CDLL:
    """The kernel at git revision ``rev``, built with this CPU's variant flags."""
    source = out / "baseline_kernel.c"
    source.write_text(
        subprocess.run(
            ["git", "show", f"{rev}:mtplx/quant_kernel.c"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    lib = out / "baseline.so"
    flags = quant._VARIANTS[quant.kernel_variant()][1]
    subprocess.run(
        ["cc", *quant._C_FLAGS, *flags, "-shared", str(source), "-o", str(lib)], check=True
    )
    return ctypes.CDLL(str(lib))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--baseline", help="git revision whose int8 entry to compare")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    ext = quant.load_extension()
    quant.set_threads(1)
    lib = ctypes.CDLL(ext.__file__)
    entries = {"float32": lib.mtplx_qmm, "int8": lib.mtplx_qmm_int8}
    tmp = tempfile.TemporaryDirectory()
    if args.baseline:
        entries = {
            "float32": lib.mtplx_qmm,
            f"int8 @{args.baseline}": _baseline(args.baseline, Path(tmp.name)).mtplx_qmm_int8,
            "int8": lib.mtplx_qmm_int8,
        }
    ptr = ctypes.c_void_p
    for fn in entries.values():
        fn.argtypes = [ptr, ctypes.c_int, ctypes.c_int, ptr, ptr, ptr, ctypes.c_int]
        fn.argtypes += [ctypes.c_int, ctypes.c_int, ctypes.c_int, ptr]
        fn.restype = ctypes.c_int
    names = list(entries)
    print(f"kernel: {quant.quant_info().kernel}; load before: {os.getloadavg()}")
    print("| product | rows | " + " | ".join(f"{m} ms" for m in names) + " | float32 / int8 |")
    print("|---|---|" + "---|" * (len(names) + 1))
    totals = dict.fromkeys(names, 0.0)
    for name, n, k, bits in SHAPES:
        packed, scales, biases = _weights(n, k, bits)
        for rows in rows_list:
            x = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32)
            y = np.zeros((rows, n), np.float32)
            calls = max(1, int(2e7 // (n * k * rows)))  # ~>1 ms of work a sample
            times: dict[str, list[float]] = {mode: [] for mode in entries}
            for _ in range(args.repeats):
                for mode, fn in entries.items():
                    start = time.thread_time()
                    for _ in range(calls):
                        status = fn(
                            x.ctypes.data, rows, k, packed.ctypes.data, scales.ctypes.data,
                            biases.ctypes.data, 1, n, bits, GROUP, y.ctypes.data,
                        )  # fmt: skip
                        assert status == 0
                    times[mode].append(1e3 * (time.thread_time() - start) / calls)
            med = {mode: statistics.median(t) for mode, t in times.items()}
            if rows == 1:
                per_token = (30 if not name.startswith("LM") else 1) * (
                    2 if name.startswith("gate") else 1
                )
                for mode in names:
                    totals[mode] += per_token * med[mode]
            cells = " | ".join(f"{med[m]:.3f}" for m in names)
            print(f"| {name} | {rows} | {cells} | {med['float32'] / med['int8']:.2f}x |")
    print(
        "one token's products (30 layers + LM head, 1 row): "
        + ", ".join(f"{m} {totals[m]:.2f} ms" for m in names)
        + f"; float32 / int8 {totals['float32'] / max(totals['int8'], 1e-9):.2f}x"
    )
    print(f"load after: {os.getloadavg()}")
    tmp.cleanup()


if __name__ == "__main__":
    main()
