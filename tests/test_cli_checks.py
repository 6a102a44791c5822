"""The CLI refuses what cannot serve before anything starts (issue 64, item 5): every number out of its range is
argparse's one-line error (exit 2), and `serve --http-port` without Ray Serve's packages (the `serve` extra) says
which extra to install, in a line, before it joins Ray."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from dspark_ray.cli import SERVE_EXTRA, main, parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def subcommands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_no_numeric_option_takes_a_bare_int_or_float():
    """A bare `type=int` / `type=float` lets -1 or nan through to where it breaks later: each has a range (or
    choices)."""
    bare = [f"{cmd} {'/'.join(a.option_strings)}" for cmd, sp in subcommands().items() for a in sp._actions
            if a.type in (int, float) and a.choices is None]      # --tp 1|2 is its choices
    assert bare == []


@pytest.mark.parametrize("argv,why", [
    (["serve", "--stop-timeout", "-1"], "argument --stop-timeout: -1: must be > 0"),
    (["serve", "--stop-timeout", "0"], "argument --stop-timeout: 0: must be > 0"),
    (["serve", "--collective-timeout", "nan"], "argument --collective-timeout: nan: must be > 0"),
    (["serve", "--idle-timeout", "-5"], "argument --idle-timeout: -5: must be >= 0"),
    (["serve", "--pairs", "0"], "argument --pairs: 0: must be >= 1"),
    (["serve", "--slots", "0"], "argument --slots: 0: must be >= 1"),
    (["serve", "--max-batch", "-2"], "argument --max-batch: -2: must be >= 1"),
    (["serve", "--max-connections", "0"], "argument --max-connections: 0: must be >= 1"),
    (["serve", "--spare-ranks", "5"], "argument --spare-ranks: 5: must be >= 0 and <= 4"),
    (["serve", "--port", "70000"], "argument --port: 70000: must be >= 0 and <= 65535"),
    (["serve", "--http-port", "0"], "argument --http-port: 0: must be >= 1 and <= 65535"),
    (["serve", "--spin-ms", "inf"], "argument --spin-ms: inf: must be >= 0"),
    (["serve", "--slots", "1.5"], "argument --slots: '1.5' is not an integer"),
    (["demo", "--rounds", "0"], "argument --rounds: 0: must be >= 1"),
    (["step", "--endpoint", "h:1", "--requests", "-1"], "argument --requests: -1: must be >= 1"),
    (["step", "--endpoint", "h:1", "--seed", "-1"], "argument --seed: -1: must be >= 0"),
    (["synth", "--preset", "tiny", "--out", "x", "--shard-gb", "0"], "argument --shard-gb: 0: must be > 0"),
    (["synth", "--preset", "tiny", "--out", "x", "--with-trunk", "--disagree", "2"],
     "argument --disagree: 2: must be >= 0 and <= 1"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_a_number_out_of_its_range_is_refused_in_one_line_before_anything_starts(argv, why, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.splitlines()[-1] == f"dspark-ray {argv[0]}: error: {why}", err


def test_the_stop_timeout_and_the_idle_timeout_keep_their_meaning():
    a = parser().parse_args(["serve", "--stop-timeout", "2.5", "--idle-timeout", "0", "--port", "0"])
    assert (a.stop_timeout, a.idle_timeout, a.port) == (2.5, 0.0, 0)          # idle 0: never


def test_http_port_without_the_serve_extra_is_one_line_naming_it_before_joining_ray(tmp_path):
    """A path entry whose `starlette` fails to import, as in an environment without Ray Serve's packages: `serve
    --http-port` exits 2 with one line naming `.[serve]`, no traceback, and never reaches Ray (the address given
    has no cluster, which it would otherwise report). Without --http-port the same environment goes on to Ray."""
    shadow = tmp_path / "shadow" / "starlette"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'starlette'\", "
                                        "name='starlette')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shadow.parent), ROOT, os.environ.get("PYTHONPATH", "")]))

    def serve(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "dspark_ray.cli", "serve", "--checkpoint", str(tmp_path),
                               "--tp", "1", "--address", "127.0.0.1:9", *extra], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
    p = serve("--http-port", "8123")
    assert p.returncode == 2 and p.stdout == "", p.stdout + p.stderr
    assert p.stderr.strip().splitlines() == [
        f"dspark-ray serve: --http-port needs Ray Serve's packages, the `serve` extra (starlette is not installed): "
        f"{SERVE_EXTRA}"], p.stderr
    assert SERVE_EXTRA == "pip install -e '.[serve]'"
    p = serve()
    assert p.returncode == 1 and "does not answer" in p.stderr and "serve extra" not in p.stderr, p.stdout + p.stderr
