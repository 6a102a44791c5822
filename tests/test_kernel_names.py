"""The fused kernels are looked up by name: a name no kernel has fails loudly instead of taking the slow path, when a
kernel set is built and when a kernel is looked up."""
from __future__ import annotations

import dataclasses

import pytest

from dspark_ray.model import ops


def _kernel(*args):
    return None


def test_an_unknown_kernel_name_raises_when_built_and_when_looked_up():
    with pytest.raises(KeyError, match="atend"):
        ops.Kernels(mode="custom", fused_table={"attend": _kernel, "atend": _kernel})
    for kernels in (ops.EXACT, ops.Kernels(mode="custom", fused_table={"attend": _kernel})):
        with pytest.raises(KeyError, match="atend"):
            kernels.fused("atend")
        with pytest.raises(KeyError, match="atend"):
            kernels.without("atend")
    with pytest.raises(KeyError, match="atend"):
        ops.fused("atend")                              # the active kernels' lookup (the model's)
    assert ops.EXACT.fused("attend") is None             # a known name the set lacks: the reference chain


def test_a_kernel_set_is_a_value_no_holder_can_change():
    table = {"swiglu": _kernel}
    kernels = ops.Kernels(mode="custom", fused_table=table)
    table["rms_norm"] = _kernel                          # the caller's dict is not the set's
    assert kernels.fused("rms_norm") is None and kernels.fused("swiglu") is _kernel
    with pytest.raises(TypeError):
        kernels.fused_table["rms_norm"] = _kernel
    with pytest.raises(dataclasses.FrozenInstanceError):
        kernels.mode = "fast"
    less = kernels.without("swiglu")
    assert less.fused("swiglu") is None and less.mode == "custom" and kernels.fused("swiglu") is _kernel
    assert ops.EXACT == ops.Kernels() and ops.EXACT.fused_table == {} and ops.EXACT.dense is None


def test_using_refuses_what_is_not_a_kernel_set_and_restores_the_one_before():
    inner = ops.Kernels(mode="custom")
    with ops.using(inner):
        assert ops.active() is inner
        with pytest.raises(TypeError, match="ops.Kernels"):
            with ops.using("fast"):
                pass
        assert ops.active() is inner
    assert ops.active() is ops.EXACT


def test_every_kernel_the_fast_path_has_has_a_known_name():
    pytest.importorskip("triton")
    from dspark_ray.kernels import fused, gemm
    installed = set(gemm.kernels_for("fast").fused_table)
    assert set(fused.TABLE) <= installed <= ops.FUSED_NAMES
    assert installed == ops.FUSED_NAMES          # and no listed name is one the fast path forgot
