"""The README's commands run as written: every line of its ```bash blocks, in order, in one fresh Ray head.

A newcomer copies these lines; a line that no longer works must fail CI, not them. The only edits are the README's
own placeholders: DIR (a new folder) and PORT (the port `serve` printed). `bash test.sh` is the suite itself, so its
set-up line (`source scripts/env.sh`, the first thing test.sh does) runs in its place.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def readme_commands() -> list[str]:
    """Every command line of the README's bash blocks, comments stripped, in order."""
    text = open(os.path.join(ROOT, "README.md")).read()
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def test_readme_shows_every_command_a_newcomer_needs():
    cmds = readme_commands()
    for want in ("bash run.sh", "bash test.sh", "source scripts/env.sh", "dspark-ray synth", "dspark-ray serve --detach",
                 "dspark-ray status", "dspark-ray step", "dspark-ray stop"):
        assert any(c.startswith(want) for c in cmds), f"the README shows no `{want}` line"
    # run.sh is `dspark-ray demo` with its arguments; test.sh's first command is its set-up, which the run below
    # stands in for it
    assert 'exec dspark-ray demo "$@"' in open(os.path.join(ROOT, "run.sh")).read()
    body = [ln for ln in open(os.path.join(ROOT, "test.sh")).read().splitlines() if ln and not ln.startswith("#")]
    assert body[:2] == ["set -e", 'source "$(dirname "$0")/scripts/env.sh"'], body[:2]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.skipif(not _port_free(6379), reason="a Ray head already listens on 6379 (README: `ray start --head`)")
def test_every_readme_command_runs_as_written():
    tmp = tempfile.mkdtemp(prefix="dr-", dir="/tmp")      # short: Ray's socket paths live under TMPDIR
    env = dict(os.environ, TMPDIR=tmp, DSPARK_CACHE=os.path.join(tmp, "cache"), RAY_ADDRESS="")
    env.pop("RAY_ADDRESS")
    fill = {"DIR": os.path.join(tmp, "ckpt")}
    ran = []
    try:
        for line in readme_commands():
            cmd = "source scripts/env.sh" if line == "bash test.sh" else line
            for k, v in fill.items():
                cmd = re.sub(rf"\b{k}\b", v, cmd)
            # one shell per line, each after the README's set-up line, as a reader's terminal would hold it
            p = subprocess.run(["bash", "-c", f"source scripts/env.sh >/dev/null && {cmd}"], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=600)
            out = p.stdout + p.stderr
            assert p.returncode == 0, f"README line `{line}` exited {p.returncode}:\n{out[-3000:]}"
            ran.append(line)
            if line.startswith("dspark-ray serve"):
                m = re.search(r"STEP endpoint [\d.]+:(\d+)", out)
                assert m, out[-2000:]
                fill["PORT"] = m.group(1)
            if line.startswith("dspark-ray status"):
                assert "generation" in out, out[-2000:]
            if line.startswith("dspark-ray step") or line == "bash run.sh":
                assert re.search(r"drafts?", out), out[-2000:]
        assert len(ran) == len(readme_commands())
    finally:
        subprocess.run(["bash", "-c", "source scripts/env.sh >/dev/null && ray stop --force"], cwd=ROOT, env=env,
                       capture_output=True, timeout=120)
        shutil.rmtree(tmp, ignore_errors=True)
