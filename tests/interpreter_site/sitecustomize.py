"""Loaded by every interpreter subprocess of the CPU tests (tests/interpreter.py puts this folder on PYTHONPATH).

Triton's interpreter runs `tl.dot` as numpy's matmul, i.e. OpenBLAS's sgemm, whose kernel is picked per CPU (or by
OPENBLAS_CORETYPE, which some hosts set: Haswell on the CI machines). Its AVX2 kernel gives a row different bits
at another position of the tile, where a GPU's MMA tile does not; the "a row alone equals the row in its batch"
checks then fail for a reason that is numpy's, not the kernel's. The dot below sums each output element over k in
one fixed order whatever the other rows hold (numpy's einsum without BLAS), which is the property the checks rely
on from the GPU; everything else of the interpreter is left as it is.
"""
import os

if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        import numpy as np
        from triton.runtime import interpreter as _interp
    except ImportError:         # no triton: the tests that need it skip
        pass
    else:
        _builder = _interp.InterpreterBuilder
        _dot = _builder.create_dot

        def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
            if a.data.ndim != 2 or b.data.ndim != 2 or a.dtype.primitive_bitwidth == 8:
                return _dot(self, a, b, d, input_precision, max_num_imprecise_acc)
            acc = d.data.dtype
            prod = np.einsum("mk,kn->mn", a.data.astype(acc), b.data.astype(acc), dtype=acc, optimize=False)
            return _interp.TensorHandle(prod + d.data, d.dtype.scalar)

        _builder.create_dot = create_dot
