"""With ``probe.diff`` applied to mtplx/quant_ext.cpp (an experiment, not the shipped code;
build it under an own MTPLX_HOME): ``engine_copies.py`` for 48 tokens, pad 0, 2 rounds, then
the probe of every store the layer node copied: whether its buffer had exactly one owner
besides the node's input, and whether it was free to hand over once the stream had run
everything queued (``mx::synchronize`` inside the node's eval, then the donation check again).

    python probe_run.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.argv = [sys.argv[0], "48", "0", "2"]
sys.path.insert(0, str(Path(__file__).parent))

import engine_copies  # noqa: E402

from mtplx.quant import load_extension  # noqa: E402

engine_copies.main()
print(
    "probe [data held by exactly one more owner, other, donatable once the stream drained]:",
    load_extension().probe(),
)
