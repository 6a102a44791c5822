"""The environment of a subprocess that runs the Triton kernels under the interpreter (the CPU tests' stand-in
for the GPU), so TRITON_INTERPRET does not leak into the other tests of the session."""
from __future__ import annotations

import os
import platform

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def interpreter_env() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # The interpreter's tl.dot is numpy's matmul. OpenBLAS's AVX2 (Haswell) sgemm kernel, which it picks on an AMD
    # EPYC, gives a row different bits at another position in the tile (rows 7 and 39 of rows_linear alone against
    # in their block), where the GPU's tile does not; its AVX (Sandybridge) kernel keeps a row's bits wherever it
    # sits, as the "alone" checks need. Every x86-64 CPU since 2011 runs it.
    if platform.machine() in ("x86_64", "AMD64"):
        env.setdefault("OPENBLAS_CORETYPE", "Sandybridge")
    return env
