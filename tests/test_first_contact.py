"""What a newcomer meets first (issue 64, item 6): `source scripts/env.sh` leaves their shell as it was, the CLI's
help and output say what they mean in words, and what `serve` prints is one endpoint line and tensor counts that
agree with the checkpoint."""
from __future__ import annotations

import os
import shutil
import subprocess

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
