"""bench/card_procs.py: the GPU benches' process harness, checked on the CPU (each body sees its card number, its
pinned vCPU, the pair's shared port and barrier block; an error comes back with the process named)."""
from __future__ import annotations

import os

import pytest

from bench import card_procs

CPUS = sorted(os.sched_getaffinity(0))


def where_am_i(rank: int, port: int, shm_name: str, tag: str) -> dict:
    from multiprocessing import shared_memory
    shm = shared_memory.SharedMemory(name=shm_name)
    first_byte = shm.buf[0]
    shm.close()
    return {"rank": rank, "port": port, "tag": tag, "card": os.environ["CUDA_VISIBLE_DEVICES"],
            "cpus": sorted(os.sched_getaffinity(0)), "shm_byte": first_byte}


def fails(rank: int, port: int, shm_name: str) -> dict:
    if rank == 1:
        raise ValueError("rank 1 refuses")
    return {}


def alone(tag: str) -> dict:
    return {"tag": tag, "card": os.environ["CUDA_VISIBLE_DEVICES"], "cpus": sorted(os.sched_getaffinity(0))}


def test_pair_runs_each_rank_on_its_card_and_vcpu_with_one_port_and_barrier_block():
    r0, r1 = card_procs.run_pair(where_am_i, "x", cpus=(CPUS[0], CPUS[-1]), timeout_s=120)
    assert (r0["rank"], r0["card"], r0["cpus"]) == (0, "0", [CPUS[0]])
    assert (r1["rank"], r1["card"], r1["cpus"]) == (1, "1", [CPUS[-1]])
    assert r0["port"] == r1["port"] and r0["tag"] == r1["tag"] == "x"
    assert r0["shm_byte"] == r1["shm_byte"] == 0          # the barrier's counters start at zero


def test_one_card_alone_sees_card_0_and_an_error_names_its_process():
    assert card_procs.run_alone(alone, "y", timeout_s=120) == {"tag": "y", "card": "0", "cpus": CPUS}
    with pytest.raises(RuntimeError, match="pair rank 1: ValueError: rank 1 refuses"):
        card_procs.run_pair(fails, timeout_s=120)


def test_pinned_reads_one_entry_of_a_cpu_list():
    assert card_procs.pinned("2,3", 1) == 3 and card_procs.pinned("", 0) is None


TAG = "as imported"


def set_tag(value: str) -> None:
    global TAG
    TAG = value


def read_tag() -> dict:
    return {"tag": TAG}


def test_children_run_the_named_setup_before_the_body(monkeypatch):
    """A wrapper's change to a module (dense_variants' kernel variants) reaches the spawned children only through
    SETUP_ENV: without it they see the module as imported."""
    assert card_procs.run_alone(read_tag, timeout_s=120)["tag"] == "as imported"
    monkeypatch.setenv(card_procs.SETUP_ENV, f"{__name__}:set_tag:from the parent")
    assert card_procs.run_alone(read_tag, timeout_s=120)["tag"] == "from the parent"


def test_expert_variants_change_what_the_kernel_reads(monkeypatch):
    """dense_variants' expert variants (the in-step A/B tool) replace what `fused_moe._grouped` reads: the last
    few-pair tier's bound, and the tiles by expert width at every pair count."""
    from bench import dense_variants
    from dspark_ray.kernels import chunked_linear, fused_moe
    monkeypatch.setattr(fused_moe, "FEW_PAIR_TIERS", fused_moe.FEW_PAIR_TIERS)
    monkeypatch.setattr(fused_moe, "grouped_tiles", fused_moe.grouped_tiles)
    monkeypatch.setattr(chunked_linear, "tiles", chunked_linear.tiles)
    few = fused_moe.FEW_PAIR_TIERS[-1][1][(True, 1152, 5120)]
    assert fused_moe.grouped_tiles(True, 1152, 5120, None, 45) == few
    dense_variants.install("few_pairs:30")
    assert fused_moe.grouped_tiles(True, 1152, 5120, None, 30) == few
    assert fused_moe.grouped_tiles(True, 1152, 5120, None, 45) == fused_moe.GROUPED_TILES[True]
    dense_variants.install("experts:g1152=16.256.4.4.32")
    assert fused_moe.grouped_tiles(True, 1152, 5120, None, 45) == fused_moe.ExpertTiles(16, 256, 4, 4, 32)
    assert fused_moe.grouped_tiles(False, 5120, 1152, None, 45) == fused_moe.GROUPED_TILES[False]   # not named
