"""The DSPARK_* knobs: one object, parsed strictly, handed on to other processes unchanged."""
from __future__ import annotations

from pathlib import Path

import pytest

from dspark_ray.settings import Settings


def test_defaults_and_every_knob_read_from_the_environment():
    assert Settings.from_env({}) == Settings()
    env = {"DSPARK_CACHE": "/tmp/dsc", "DSPARK_KEEP_WARM": "0", "DSPARK_KEEP_WARM_US": "50",
           "DSPARK_KEEP_WARM_HOLD_US": "0", "DSPARK_KEEP_WARM_LAUNCH_US": "0", "DSPARK_STEP_GRAPHS": "0",
           "DSPARK_PDL": "0", "DSPARK_PUSH_TIMEOUT_MS": "500", "DSPARK_STAMP_CPU": "1", "HOME": "/elsewhere"}
    s = Settings.from_env(env)
    assert s == Settings(cache_dir=Path("/tmp/dsc"), keep_warm=False, keep_warm_us=50.0, keep_warm_hold_us=0.0,
                         keep_warm_launch_us=0.0, step_graphs=False, pdl=False, push_timeout_ms=500.0,
                         stamp_cpu=True)
    assert s.kernel_cache == Path("/tmp/dsc/kernels")          # one cache folder
    assert Settings.from_env(s.as_env()) == s                    # what another process reads is the same
    assert Settings.from_env(Settings().as_env()) == Settings()
    assert "DSPARK_CACHE" not in Settings().as_env() and Settings().as_env()["DSPARK_KEEP_WARM"] == "1"
    assert "keep_warm=False" in s.describe() and Settings().describe().startswith("settings: defaults")


@pytest.mark.parametrize("var,value", [("DSPARK_KEEP_WARM", "off"), ("DSPARK_KEEP_WARM_US", "-1"),
                                       ("DSPARK_PUSH_TIMEOUT_MS", "soon"), ("DSPARK_STEP_GRAPHS", "2")])
def test_a_malformed_knob_is_refused_by_its_name(var, value):
    with pytest.raises(ValueError, match=var):
        Settings.from_env({var: value})
