"""A drafter is handed its kernels (`ops.Kernels`) and runs on them alone: two drafters with different kernels in one
process each run on their own, on whatever thread calls them, through the graph set too, and leave nothing set
behind them.

The kernels here are the exact reference with counting wrappers (the same math, so the same bits): what a drafter ran
on shows in which counter moved."""
from __future__ import annotations

import threading

import pytest
import torch

from dspark_ray.testing import workload
from dspark_ray.testing.batches import placed
from dspark_ray.rank.graphs import GraphSet
from dspark_ray.model import ops
from dspark_ray.model.drafter import Drafter
from dspark_ray.rank.modes import make_drafter


def _counting(name: str, calls: list) -> ops.Kernels:
    """The exact kernels, each dense matmul and each pack of the graph set's outputs appended to `calls` as
    (name, thread id)."""
    def matmul(x, w):
        calls.append((name, threading.get_ident()))
        return ops.linear_tree(x, w)

    def pack_outputs(drafts, confidences, margins, confident_len):     # the reference packing (graphs/step_functions.py)
        calls.append((name, threading.get_ident()))
        parts = [drafts, confidences] + ([margins] if margins is not None else []) + [confident_len[:, None]]
        return torch.cat([p.to(torch.float64) for p in parts], dim=1)
    return ops.Kernels(mode=name, matmul=matmul, fused_table={"pack_outputs": pack_outputs})


def _filled(d: Drafter, seed: int = 0):
    st = d.new_slot()
    d.insert(st, 0, workload.make_taps(d.cfg, 9, torch.Generator().manual_seed(seed)))
    return st


def _same(a, b) -> bool:
    return all(torch.equal(getattr(a, k), getattr(b, k)) for k in ("drafts", "confidences", "confident_len", "margins"))


def test_two_drafters_each_run_on_their_own_kernels_and_leave_none_set(cfg, full_weights):
    calls: list = []
    mine = make_drafter(cfg, "tp1", full=full_weights, kernels=_counting("mine", calls))
    plain = make_drafter(cfg, "tp1", full=full_weights)
    assert plain.kernels is ops.EXACT and mine.kernels.mode == "mine"
    want = plain.draft([_filled(plain)], [5], cfg.block_size, want_margins=True)
    assert calls == [] and ops.active() is ops.EXACT
    got = mine.draft([_filled(mine)], [5], cfg.block_size, want_margins=True)
    n = len(calls)
    assert n > 0 and {c[0] for c in calls} == {"mine"}
    assert _same(got, want)                          # the counting kernels are the exact ones
    assert ops.active() is ops.EXACT                 # nothing left set in the caller's context
    again = plain.draft([_filled(plain)], [5], cfg.block_size, want_margins=True)
    assert len(calls) == n and _same(again, want)    # the plain drafter never ran on the other's kernels


def test_a_drafter_called_from_a_fresh_thread_runs_on_its_kernels(cfg, full_weights):
    """A new thread starts with the default context (the exact kernels): the drafter's entry points set its own."""
    calls: list = []
    d = make_drafter(cfg, "tp1", full=full_weights, kernels=_counting("mine", calls))
    st = _filled(d)
    calls.clear()
    seen = {}

    def work():
        seen["before"] = ops.active()
        seen["out"] = d.draft([st], [5], cfg.block_size, want_margins=True)
        _filled(d, seed=1)                           # an insert too
        seen["after"] = ops.active()
        seen["ident"] = threading.get_ident()
    t = threading.Thread(target=work)
    t.start()
    t.join(60)
    assert not t.is_alive()
    assert seen["before"] is ops.EXACT and seen["after"] is ops.EXACT
    assert calls and {c for c in calls} == {("mine", seen["ident"])}


def test_the_graph_set_runs_on_its_drafters_kernels(cfg, full_weights):
    """The uncaptured run (a CPU's) packs its outputs and computes its inserts on the drafter's kernels, whoever
    calls it: the same bits as the eager drafter."""
    calls: list = []
    d = make_drafter(cfg, "tp1", full=full_weights, kernels=_counting("mine", calls))
    gs = GraphSet(d, n_slots=2, max_requests=1, n_outs=(cfg.block_size,), insert_buckets=(16,))
    gs.capture()
    taps = workload.make_taps(cfg, 9, torch.Generator().manual_seed(0))
    got = gs.run(placed([(gs.slots[0], 0, taps)]), [gs.slots[0]], [5], cfg.block_size, True)
    assert calls and ops.active() is ops.EXACT
    plain = make_drafter(cfg, "tp1", full=full_weights)
    st = plain.new_slot()
    plain.insert(st, 0, taps)
    assert _same(got, plain.draft([st], [5], cfg.block_size, want_margins=True))


def test_the_insert_by_block_generator_keeps_its_kernels_to_its_own_steps(cfg, full_weights):
    """Each step of `context_rows_by_block` runs on the drafter's kernels; between the steps the caller's context
    holds its own (here the default), and an unfinished generator leaves nothing set."""
    calls: list = []
    d = make_drafter(cfg, "tp1", full=full_weights, kernels=_counting("mine", calls))
    taps = workload.make_taps(cfg, 4, torch.Generator().manual_seed(2))
    rows = d.context_rows_by_block(taps, torch.arange(4))
    first = next(rows)
    assert calls and ops.active() is ops.EXACT
    n = len(calls)
    ops.linear(taps, full_weights["mtp.0.main_proj.weight"])
    assert len(calls) == n                           # the caller's own op between the steps: the default kernels
    rest = list(rows)
    assert len(calls) > n and len(rest) == cfg.n_blocks - 1
    assert all(torch.equal(a, b) for a, b in zip([first] + rest, make_drafter(cfg, "tp1", full=full_weights)
                                                   .context_rows(taps, torch.arange(4))))
    unfinished = d.context_rows_by_block(taps, torch.arange(4))
    next(unfinished)
    del unfinished
    assert ops.active() is ops.EXACT


def test_a_drafter_refuses_kernels_that_are_not_a_kernel_set(cfg, full_weights):
    with pytest.raises(TypeError, match="ops.Kernels"):
        make_drafter(cfg, "tp1", full=full_weights, kernels="fast")


def test_weights_that_launch_serially_take_every_branch_in_line(cfg, full_weights):
    """A weight whose kernels must not run beside each other (`Exl3Weight.serial_launches`) makes its drafter run
    without the branch kernels; the drafter's other kernels, and the set it was handed, stay as they are."""
    def branch(fn, *args):
        return ops.Ready(fn(*args))

    def branch_parts(fn, *args):
        return [ops.Ready(v) for v in fn(*args)]
    pack = _counting("mine", []).fused("pack_outputs")
    handed = ops.Kernels(mode="mine", fused_table={"branch": branch, "branch_parts": branch_parts, "pack_outputs": pack})
    assert Drafter(cfg, [full_weights], kernels=handed).kernels is handed
    serial = dict(full_weights)
    name = "mtp.0.attn.wo_b.weight"
    serial[name] = full_weights[name].clone()        # (the session's tensor stays unmarked)
    serial[name].serial_launches = True
    d = Drafter(cfg, [serial], kernels=handed)
    assert d.kernels.fused("branch") is None and d.kernels.fused("branch_parts") is None
    assert d.kernels.fused("pack_outputs") is pack and d.kernels.mode == "mine"
    assert handed.fused("branch") is branch
