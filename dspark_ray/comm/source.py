"""The push kernels' CUDA source (`push.cu`, with `peer_state.Layout`'s offsets prepended) and its NVRTC build.

Built by NVRTC directly, not `cupy.RawModule`, which appends `-ftz=true` (docs/collectives.md, "Denormals are
kept"). The cubin is cached on disk by source, options and architecture: the second rank loads the first's.
"""
from __future__ import annotations

import hashlib
import os
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


def _cache_dir() -> Path:
    from ..settings import current
    return current().kernel_cache


def compile_module(layout: Layout, extra_defines: dict[str, int] | None = None):
    """Compile (or load from the disk cache) and return {kernel name: cupy Function}. Needs CUDA and CuPy."""
    import cupy as cp
    from cupy.cuda import compiler
    src = kernel_source(layout, extra_defines)
    cc = cp.cuda.Device().compute_capability
    key = hashlib.sha256(f"{src}\0{COMPILE_OPTIONS}\0{cc}\0{compiler._get_nvrtc_version()}".encode()).hexdigest()
    path = _cache_dir() / f"push-{key[:24]}.bin"
    if path.is_file():
        binary = path.read_bytes()
    else:
        binary, _ = compiler.compile_using_nvrtc(src, COMPILE_OPTIONS, filename="push.cu")
        binary = binary if isinstance(binary, bytes) else binary.encode()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(binary)
        os.replace(tmp, path)               # atomic: the peer rank never reads a half-written file
    mod = cp.cuda.function.Module()
    mod.load(binary)
    return {name: mod.get_function(name) for name in KERNELS}
