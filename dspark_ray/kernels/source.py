"""The push kernels' CUDA source and its run-time compilation (CuPy RawModule / NVRTC).

The source lives in `push.cu` beside this file; the layout constants are prepended from `peer_state.Layout`, so the
Python side and the kernels cannot disagree on an offset. CuPy caches the compiled module on disk (keyed by the
source), so the second rank of a pair loads what the first compiled.
"""
from __future__ import annotations

from pathlib import Path

from .peer_state import Layout

KERNELS = ("push_all_reduce", "push_all_reduce_lamport", "push_exchange", "push_cancel", "push_hello", "push_fill")
COMPILE_OPTIONS = ("-std=c++17", "--ftz=false", "--fmad=true")   # the adds must round exactly like torch's
_SRC = Path(__file__).with_name("push.cu")


def kernel_source(layout: Layout, extra_defines: dict[str, int] | None = None) -> str:
    head = layout.cuda_defines()
    for k, v in (extra_defines or {}).items():
        head += f"#define {k} {v}\n"
    return head + _SRC.read_text()


def compile_module(layout: Layout, extra_defines: dict[str, int] | None = None):
    """Compile (or load from CuPy's cache) and return {kernel name: cupy RawKernel}. Needs CUDA and CuPy."""
    import cupy as cp
    mod = cp.RawModule(code=kernel_source(layout, extra_defines), options=COMPILE_OPTIONS)
    return {name: mod.get_function(name) for name in KERNELS}
