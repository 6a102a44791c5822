"""bench/draft_step.py's summary and table, from the committed H200 pair result (bench/results/draft_step_h200x2.json):
the ratios are those of the measured figures, and the GPU's part is reported beside the step."""
from __future__ import annotations

import json
from pathlib import Path

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


def test_kernel_benches_refuse_cleanly_without_cuda(capsys):
    """The one-card kernel benches parse their command line and, on a host without CUDA, say so and exit 2 (what
    `kernel_bench.start` gives them) instead of failing somewhere in their set-up."""
    import importlib

    import pytest
    import torch
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the benches would run")
    for name in ("markov_step", "l2_retention", "router_overlap", "expert_tiles", "chunked_linear"):
        assert importlib.import_module(f"bench.{name}").main(["--reps", "1"]) == 2, name
        assert f"{name}: needs CUDA" in capsys.readouterr().err
