"""The README's commands run as written: every line of its ```bash blocks, in order, in one fresh Ray head.

A newcomer copies these lines; a line that no longer works must fail CI, not them. The only edits are the README's
own placeholders: DIR (a new folder) and PORT (the port `serve` printed). `bash test.sh` is the suite itself, so its
set-up line (`source scripts/env.sh`, the first thing test.sh does) runs in its place.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
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


def run_readme(tmp: str) -> dict:
    """Every README line in order, each in its own shell after the set-up line, as a reader's terminal would hold
    them; the first failing line ends the run. Returns what ran and the failure, if any."""
    env = dict(os.environ, TMPDIR=tmp, DSPARK_CACHE=os.path.join(tmp, "cache"))
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_TMPDIR", None)         # (the test session's, conftest.py): this run's Ray keeps to TMPDIR
    fill = {"DIR": os.path.join(tmp, "ckpt")}
    ran: list[str] = []
    for line in readme_commands():
        cmd = "source scripts/env.sh" if line == "bash test.sh" else line
        for k, v in fill.items():
            cmd = re.sub(rf"\b{k}\b", v, cmd)
        p = subprocess.run(["bash", "-c", f"source scripts/env.sh >/dev/null && {cmd}"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
        out = p.stdout + p.stderr
        why = None
        if p.returncode != 0:
            why = f"exited {p.returncode}"
        elif line.startswith("dspark-ray serve"):
            m = re.search(r"STEP endpoint [\d.]+:(\d+)", out)
            t = re.search(r"token file (\S+) on ", out)
            if m and t:
                fill["PORT"], fill["TOKEN"] = m.group(1), t.group(1)
            else:
                why = "printed no STEP endpoint or no token file"
        elif line.startswith("dspark-ray status") and "generation" not in out:
            why = "showed no worker generation"
        elif (line.startswith("dspark-ray step") or line == "bash run.sh") and \
                (not re.search(r": drafts \[", out) or re.search(r": [A-Z_]+: ", out)):
            why = "showed no drafts, or a request answered otherwise than OK"
        if why:
            return {"ran": ran, "failed": line, "why": why, "output": out[-3000:]}
        ran.append(line)
    return {"ran": ran, "failed": None}


@pytest.mark.skipif(shutil.which("unshare") is None or shutil.which("ip") is None or os.geteuid() != 0,
                    reason="needs unshare as root and ip: the README's `ray stop` must see only this run's Ray")
def test_every_readme_command_runs_as_written():
    """In a PID and network namespace of its own: the README's `ray stop` stops every Ray process it can see, which
    would otherwise include this test session's own cluster (and anyone else's on the host), and its `ray start
    --head` takes Ray's default port 6379, which another suite's run of this test may hold at the same time."""
    tmp = tempfile.mkdtemp(prefix="dr-", dir="/tmp")      # short: Ray's socket paths live under TMPDIR
    try:
        inner = 'ip link set lo up && exec "$@"'
        p = subprocess.run(["unshare", "--pid", "--net", "--fork", "--mount-proc", "bash", "-c", inner, "bash",
                            sys.executable, __file__, tmp], cwd=ROOT, capture_output=True, text=True, timeout=1500)
        assert p.returncode == 0, p.stderr[-3000:]
        res = json.loads(p.stdout.strip().splitlines()[-1])
        assert res["failed"] is None, f"README line `{res['failed']}` {res['why']}:\n{res['output']}"
        assert res["ran"] == readme_commands()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":          # inside the namespace: the run, then whatever it left behind goes with it
    print(json.dumps(run_readme(sys.argv[1])))
