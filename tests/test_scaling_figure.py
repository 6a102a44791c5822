"""bench/scaling.py's figure, drawn from the committed CPU result (bench/results/scaling_tiny_cpu.json): one line
per layout and worker count in each panel, through exactly the result's points, and the figure says CPU."""
from __future__ import annotations

import json
from pathlib import Path

from bench.scaling import figure, plot

RESULT = Path(__file__).resolve().parents[1] / "bench" / "results" / "scaling_tiny_cpu.json"


def test_the_figure_draws_each_layout_and_worker_count_through_its_measured_points(tmp_path):
    import matplotlib.pyplot as plt
    out = json.loads(RESULT.read_text())
    assert out["cpu_figures"] and out["command"].startswith("python bench/scaling.py")
    runs = [L for L in out["layouts"] if L["rows"]]
    assert {(L["layout"], L["workers"]) for L in runs} == {(lay, n) for lay in ("pairs", "one_card") for n in (1, 2, 3, 4)}
    fig = figure(out)
    rate, p50 = fig.axes[:2]
    assert len(rate.lines) == len(p50.lines) == len(runs)
    for L, lr, lp in zip(runs, rate.lines, p50.lines):
        r = [row["requests"] for row in L["rows"]]
        assert list(lr.get_xdata()) == r == list(lp.get_xdata())
        assert list(lr.get_ydata()) == [row["requests_per_s"] for row in L["rows"]]
        assert list(lp.get_ydata()) == [row["round"]["p50_ms"] for row in L["rows"]]
        assert lr.get_linestyle() == ("-" if L["layout"] == "pairs" else "--")
    assert "CPU" in fig._suptitle.get_text()
    plt.close(fig)
    plot(out, tmp_path / "scaling.png")
    assert (tmp_path / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
