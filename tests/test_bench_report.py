"""bench/report.py, what every bench's JSON carries: percentiles with their unit, the command that reproduces the
run, the commit (DSPARK_COMMIT where the tree has no git), and the file it writes."""
from __future__ import annotations

import json

from bench import report


def test_percentiles_carry_their_unit_and_scale():
    ns = [1000 * i for i in range(1, 101)]                # 1..100 us, in ns
    us = report.percentiles(ns, "us", digits=2, scale=1e-3)
    assert us == {"p50_us": 50.5, "p90_us": 90.1, "p99_us": 99.01, "min_us": 1.0, "n": 100}
    assert set(report.percentiles([2.0, 1.0], None)) == {"p50", "p90", "p99", "min", "n"}


def test_header_names_the_bench_its_command_and_commit(monkeypatch):
    monkeypatch.setenv("DSPARK_COMMIT", "abc1234")
    h = report.header("/anywhere/bench/scaling.py", ["--rounds", "3"])
    assert h["bench"] == "scaling" and h["command"] == "python bench/scaling.py --rounds 3"
    assert h["commit"] == "abc1234" and "cores" in h["device"]
    monkeypatch.delenv("DSPARK_COMMIT")
    assert report.commit() != "abc1234"


def test_write_prints_and_saves_the_same_json(tmp_path, capsys):
    out = tmp_path / "sub" / "r.json"
    report.write({"p50_ms": 1.5}, str(out))
    assert json.loads(capsys.readouterr().out) == json.loads(out.read_text()) == {"p50_ms": 1.5}
