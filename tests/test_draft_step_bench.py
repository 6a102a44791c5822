"""bench/draft_step.py: its summary and table, from the committed H200 pair result (bench/results/draft_step_h200x2.json):
the ratios are those of the measured figures, and the GPU's part is reported beside the step; and its process
harness, checked on the CPU (each body sees its card number, its pinned vCPU, the pair's shared port and barrier
block; an error comes back with the process named)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench import draft_step
from bench.draft_step import gpu_wait_us, markdown, summary

RESULT = Path(__file__).resolve().parents[1] / "bench" / "results" / "draft_step_h200x2.json"


def test_summary_ratios_are_those_of_the_measured_figures():
    out = json.loads(RESULT.read_text())
    rows = summary(out)
    assert set(rows) == set(out["tp1"]["draft"])
    r = rows["1,5"]
    tp1, pair, solo = out["tp1"]["draft"]["1,5"], out["pair"], out["solo"]["draft"]["1,5"]
    assert r["pair_over_tp1"] == round(r["pair_ms"] / r["tp1_ms"], 3)
    assert r["pair_ms"] == pair["rank0"]["draft"]["1,5"]["p50_ms"]
    # the GPU's part: the wait after the last launch, the pair's the smaller of its ranks'
    waits = [pair[k]["draft"]["1,5"]["host_p50"]["wait_us"] for k in ("rank0", "rank1")]
    assert r["pair_gpu_us"] == gpu_wait_us(out, "pair", "1,5") == min(waits)
    assert r["tp1_gpu_us"] == tp1["host_p50"]["wait_us"] and r["solo_gpu_us"] == solo["host_p50"]["wait_us"]
    assert r["pair_over_tp1_gpu"] == round(min(waits) / r["tp1_gpu_us"], 3)
    assert r["collectives_share_gpu"] == round((min(waits) - r["solo_gpu_us"]) / min(waits), 3)
    assert rows == out["summary"]                # the committed summary is this code's


def test_table_reports_the_gpu_part_beside_the_step():
    out = json.loads(RESULT.read_text())
    md = markdown(out)
    assert "The GPU's part" in md
    r = out["summary"]["1,5"]
    assert f"| 1,5 | {r['tp1_gpu_us']} | {r['pair_gpu_us']} | {r['pair_over_tp1_gpu']} |" in md
    assert md == (RESULT.with_suffix(".md")).read_text()      # the committed table is this code's
    # a run without the pair (one card only) has no pair ratios and still renders
    one = {k: v for k, v in out.items() if k not in ("pair", "solo")}
    rows = summary(one)
    assert rows["1,5"]["pair_gpu_us"] is None and "pair_over_tp1_gpu" not in rows["1,5"]
    one["summary"] = rows
    assert f"| 1,5 | {r['tp1_gpu_us']} | None |  | None |  |" in markdown(one)


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
    r0, r1 = draft_step.run_ranks(where_am_i, "x", cpus=(CPUS[0], CPUS[-1]), timeout_s=120)
    assert (r0["rank"], r0["card"], r0["cpus"]) == (0, "0", [CPUS[0]])
    assert (r1["rank"], r1["card"], r1["cpus"]) == (1, "1", [CPUS[-1]])
    assert r0["port"] == r1["port"] and r0["tag"] == r1["tag"] == "x"
    assert r0["shm_byte"] == r1["shm_byte"] == 0          # the barrier's counters start at zero


def test_one_card_alone_sees_card_0_and_an_error_names_its_process():
    assert draft_step.run_alone(alone, "y", timeout_s=120) == {"tag": "y", "card": "0", "cpus": CPUS}
    with pytest.raises(RuntimeError, match="pair rank 1: ValueError: rank 1 refuses"):
        draft_step.run_ranks(fails, timeout_s=120)


def test_pinned_reads_one_entry_of_a_cpu_list():
    assert draft_step.pinned("2,3", 1) == 3 and draft_step.pinned("", 0) is None
