"""scripts/gpu_checks.sh's control flow on the CPU: with a stand-in Python that reports N cards and runs nothing,
which steps it takes on one card and on a pair, ONLY, and a failing step's exit code (the steps themselves are the
GPU machine's)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(tmp_path, cards: int, fail: str = "", only: str | None = None,
        pin: str | None = None) -> subprocess.CompletedProcess:
    shim = tmp_path / "python"
    # the device count for the script's probe; any other call succeeds at once, except one naming `fail`
    shim.write_text(f"#!/bin/sh\ncase \"$*\" in *device_count*) echo {cards};; *{fail or '@none@'}*) exit 3;; "
                    "*) echo \"ok $*\";; esac\n")
    shim.chmod(0o755)
    env = {**os.environ, "PYTHON": str(shim)}
    if only is not None:
        env["ONLY"] = only
    env.pop("PIN_CPUS", None)
    if pin is not None:
        env["PIN_CPUS"] = pin
    return subprocess.run(["bash", "scripts/gpu_checks.sh", str(tmp_path / "out"), str(tmp_path / "ckpt")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def steps(out: str) -> list[str]:
    """The steps that ran, from their "[gpu_checks] NAME: rc N (...)" lines."""
    return re.findall(r"^\[gpu_checks\] (\S+): rc \d+ ", out, re.M)


@pytest.mark.skipif(sys.platform != "linux", reason="bash and timeout")
def test_steps_on_one_card_and_on_a_pair(tmp_path):
    one = run(tmp_path, 1)
    assert one.returncode == 0, one.stdout + one.stderr
    exl3 = ["exl3_table", "tests_exl3", "parity_exl3_tiny", "parity_exl3_full", "parity_exl3_batch4", "draft_step_exl3",
            "draft_step_bf16"]
    assert steps(one.stdout) == ["synthesize", "tests_one_card", "tests_full_graph_set", "draft_step", "step_latency",
                                 "restart"] + exl3
    pair = run(tmp_path, 2)
    assert steps(pair.stdout) == ["synthesize", "tests_one_card", "tests_full_graph_set", "tests_push_pair",
                                  "tests_deployed_pair", "draft_step", "step_latency", "restart"] + exl3 + ["scaling"]
    assert "all passed" in pair.stdout


@pytest.mark.skipif(sys.platform != "linux", reason="bash and timeout")
def test_only_and_a_failing_step(tmp_path):
    picked = run(tmp_path, 2, only="draft_step,scaling")
    assert steps(picked.stdout) == ["draft_step", "scaling"]
    failed = run(tmp_path, 1, fail="step_latency.py")
    assert failed.returncode == 1 and "some failed" in failed.stdout
    assert "step_latency: rc 3" in failed.stdout
    none = run(tmp_path, 0)
    assert none.returncode == 2 and "no CUDA device" in none.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="bash and timeout")
def test_the_draft_step_bench_is_pinned_as_the_committed_tables(tmp_path):
    """The draft-step bench starts at position 900,000 and pins its ranks to PIN_CPUS; an empty PIN_CPUS unpins."""
    pinned = run(tmp_path, 2, only="draft_step", pin="3,4")
    args = (tmp_path / "out" / "draft_step.txt").read_text()
    assert pinned.returncode == 0 and "--modes tp1,pair,solo" in args
    assert "--start 900000" in args and "--pin-cpus 3,4 " in args
    run(tmp_path, 1, only="draft_step", pin="")
    args = (tmp_path / "out" / "draft_step.txt").read_text()
    assert "--modes tp1,solo" in args and "--pin-cpus" not in args
