"""What a newcomer meets first (issue 64, item 6): `source scripts/env.sh` leaves their shell as it was, the CLI's
help and output say what they mean in words, and what `serve` prints is one endpoint line and tensor counts that
agree with the checkpoint."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def bash(script: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], cwd=ROOT, env=dict(os.environ, **env), capture_output=True,
                          text=True, timeout=120)


@needs_bash
@pytest.mark.parametrize("options", ["set +e", "set -e", "set -u", "set -eu -o pipefail"])
def test_sourcing_env_sh_leaves_the_callers_shell_options_as_they_were(options):
    """The venv on PATH, ROOT set, and the caller's options (`$-`, `set -o`) unchanged: an interactive shell that
    had no `set -e` still has none, and run.sh / test.sh keep theirs."""
    p = bash(f'{options}; before="$- $(set -o | tr -s " \\t" " ")"; source scripts/env.sh >/dev/null 2>&1; '
             f'after="$- $(set -o | tr -s " \\t" " ")"; [ "$before" = "$after" ] || {{ echo "$before / $after"; '
             f'exit 9; }}; echo "ROOT=$ROOT"; command -v python')
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"ROOT={ROOT}\n" in p.stdout and p.stdout.strip().endswith("/bin/python"), p.stdout


@needs_bash
def test_a_failing_set_up_returns_its_error_to_the_caller_without_closing_its_shell(tmp_path):
    """A venv whose pip fails: `source` returns non-zero with the reason, and the calling shell goes on (an
    interactive one is not closed), its options unchanged."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\nexit 1\n")
    (venv / "bin" / "python").chmod(0o755)
    p = bash('set +e; source scripts/env.sh; echo "rc=$? options=$-"', DSPARK_VENV=str(venv))
    assert "[env] pip install" in p.stderr and "failed" in p.stderr, p.stderr
    assert p.returncode == 0 and "rc=1 options=" in p.stdout and "e" not in p.stdout.split("options=")[1], p.stdout


# ---- what the CLI says ----------------------------------------------------------------------------------------------
def test_every_command_has_a_description_line_in_help(capsys):
    """`dspark-ray --help` lists each command with a line saying what it does (status, stop, endpoints had none)."""
    from dspark_ray.cli import parser
    from test_cli_checks import subcommands
    with pytest.raises(SystemExit):
        parser().parse_args(["--help"])
    out = capsys.readouterr().out
    for cmd in subcommands():
        line = next((ln for ln in out.splitlines() if ln.strip().startswith(cmd + " ")), "")
        assert len(line.split(None, 1)) == 2, f"no description for {cmd!r} in:\n{out}"


def test_status_says_the_supervisors_state_in_words():
    """The supervisor's own account, fresh and after a restart, as `status` prints it: words, not a Python dict."""
    import threading
    import time
    from types import SimpleNamespace

    from dspark_ray.cli import supervisor_words
    from dspark_ray.frontend.step_service import PairFailure
    from dspark_ray.frontend.supervisor import Supervisor
    restarted = threading.Event()
    service = SimpleNamespace(last_errors=[], unavailable=None, worker_generation=0, resync_all=lambda: None)
    sv = Supervisor(service, restart=restarted.set)
    assert supervisor_words(sv.status()) == "not restarting; 0 restart(s) so far; 0 failed step(s) in a row " \
                                            "(a restart at 3)"
    sv.observe(PairFailure("dead", "rank 1's process died"), [])
    assert restarted.wait(10)
    deadline = time.monotonic() + 10
    while sv.status()["restarting"]:
        assert time.monotonic() < deadline, "the restart thread did not finish"
        time.sleep(0.01)
    words = supervisor_words(sv.status())
    assert re.fullmatch(r"not restarting; 1 restart\(s\) so far \(took \d+\.\d s\); 0 failed step\(s\) in a row "
                        r"\(a restart at 3\); the last for dead: rank 1's process died: 1 attempt\(s\), serving again "
                        r"\d+\.\d s after the failure", words), words


def test_the_load_counts_the_checkpoints_tensors_as_synth_wrote_them(tiny_ckpt, capsys):
    """Two ranks each read their cut of every tensor: the line names the checkpoint's count (what `synth` wrote in
    its manifest), once, not the sum over ranks."""
    import io
    import json

    from dspark_ray.cli import LoadProgress
    n = len(json.loads((tiny_ckpt / "dspark-manifest.json").read_text())["tensors"])
    out = io.StringIO()
    progress = LoadProgress(2, stream=out)
    progress([(0, n)])
    progress([(n // 2, n), (3, n)])
    progress([(n, n), (n, n)])
    progress([(n, n), (n, n)])
    lines = out.getvalue().splitlines()
    assert lines[0] == "loading the weights on 2 rank(s) ..."
    assert len(lines) == 2 and lines[1].startswith(
        f"weights loaded: {n} tensors of the checkpoint, each of 2 rank(s) reading its cut, "), lines


def test_ray_serves_pydantic_deprecations_are_filtered_by_the_pytest_configuration(tmp_path):
    """A test importing Ray Serve, run under this project's pytest configuration, ends without a warnings summary
    (Ray Serve 2.60 raises 18 PydanticDeprecatedSince20 at its import); one of our own still shows."""
    pytest.importorskip("fastapi")                       # the serve extra
    (tmp_path / "test_serve_import.py").write_text(
        "import warnings\n\ndef test_import():\n    import ray.serve  # noqa: F401\n\n"
        "def test_ours():\n    warnings.warn('ours', DeprecationWarning)\n")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
                        os.path.join(ROOT, "pyproject.toml"), "--rootdir", ROOT, str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:]
    assert "Pydantic" not in p.stdout and "2 passed, 1 warning" in p.stdout, p.stdout[-3000:]


def test_a_worker_killed_on_purpose_leaves_no_ansi_codes_in_the_output(ray_cluster, capfd, tmp_path):
    """Ray's notice of a worker killed mid-task (as the supervision tests kill ranks) reaches the suite's output
    in plain text: the suite's environment turns Ray's colours off."""
    import signal
    import time
    ray = ray_cluster
    started = tmp_path / "started"

    @ray.remote(num_cpus=0, max_restarts=0)
    class Victim:
        def pid(self) -> int:
            return os.getpid()

        def block(self, flag: str) -> None:
            open(flag, "w").close()
            time.sleep(120)

    v = Victim.remote()
    pid = ray.get(v.pid.remote(), timeout=120)
    ref = v.block.remote(str(started))
    deadline = time.monotonic() + 120
    while not started.exists():
        assert time.monotonic() < deadline, "the victim's task did not start"
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(ref, timeout=120)
    text = ""
    deadline = time.monotonic() + 60
    while "A worker died or was killed" not in text:
        assert time.monotonic() < deadline, f"no notice of the killed worker in:\n{text}"
        out, err = capfd.readouterr()
        text += out + err
        time.sleep(0.1)
    assert "\x1b[" not in text, repr(text)


def test_the_readme_says_where_preset_writes_and_what_ray_stop_stops():
    from pathlib import Path

    from dspark_ray.settings import Settings
    text = (Path(ROOT) / "README.md").read_text()
    home = Path.home()
    assert Settings().cache_dir == home / ".cache" / "dspark-ray"
    assert "`serve --preset` writes its synthetic checkpoint under `~/.cache/dspark-ray`" in text
    assert "Ray's own `ray stop` stops every Ray cluster on the host" in text
    assert "pip install -e '.[serve]'" in text
