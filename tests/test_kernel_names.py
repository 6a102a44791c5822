"""The fused kernels are looked up by name: a name no kernel has fails loudly instead of taking the slow path."""
from __future__ import annotations

import pytest

from dspark_ray.model import ops


def test_an_unknown_kernel_name_raises_and_installs_nothing():
    before = ops.current_matmul()
    with pytest.raises(KeyError, match="atend"):
        ops.fused("atend")
    with pytest.raises(KeyError, match="atend"):
        ops.set_matmul(ops.linear_tree, fused_table={"atend": lambda *a: None})
    with pytest.raises(KeyError, match="atend"):
        ops.drop_fused("atend")
    assert ops.current_matmul() == before
    assert ops.fused("attend") is before[3].get("attend")       # a known name: installed or None


def test_every_kernel_the_fast_path_installs_has_a_known_name():
    pytest.importorskip("triton")
    from dspark_ray.kernels import fused, gemm
    before = ops.current_matmul()
    try:
        gemm.use_matmul("fast")
        installed = set(ops.current_matmul()[3])
    finally:
        ops.set_matmul(*before)
    assert set(fused.TABLE) <= installed <= ops.FUSED_NAMES
    assert installed == ops.FUSED_NAMES          # and no listed name is one the fast path forgot
