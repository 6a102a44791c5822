"""`serve` stopped however it is stopped (issue 64): SIGTERM to its whole process group (`timeout`, `kill -TERM --
-PGID`, systemd's default KillMode) reaches Ray's GCS too, an embedded one or a `ray start --head` in the group, and
`serve` still exits 0 within its `--stop-timeout`, leaving no ring or doorbell of its processes behind.

Each run is a real `dspark-ray serve` in a PID and mount namespace of its own, with its own /dev/shm: `serve` with no
`--address` joins the one cluster it sees on the host, so this session's own Ray must be out of its sight, and its
ring sweep (owners by pid) must see only this run's rings, not those of anyone else on the host.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STOP_BOUND_S = 20.0
pytestmark = pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                                reason="needs unshare as root: a PID and mount namespace of the run's own")


def in_sandbox(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """Run this file's `__main__` with `args` in a PID and mount namespace with a /dev/shm of its own. Its init is
    bash, which reaps every orphan as an init does: a Ray worker sees its raylet gone only once the raylet's zombie
    is reaped (its parent changes)."""
    inner = 'mount -t tmpfs -o size=2g,mode=1777 tmpfs /dev/shm && "$@"; exit $?'
    return subprocess.run(["unshare", "--mount", "--pid", "--fork", "--mount-proc", "bash", "-c", inner, "bash",
                           sys.executable, __file__, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s)


@pytest.mark.parametrize("ray", ["embedded", "head"], ids=["embedded Ray", "ray start --head in the group"])
def test_sigterm_to_the_whole_group_ends_serve_within_its_bound_exit_0_nothing_left(tiny_ckpt, ray):
    tmp = tempfile.mkdtemp(prefix="dr-", dir="/tmp")      # short: Ray's socket paths live under TMPDIR
    try:
        p = in_sandbox([ray, str(tiny_ckpt), tmp], timeout_s=600)
        assert p.returncode == 0, p.stderr[-3000:]
        res = json.loads(p.stdout.strip().splitlines()[-1])
        assert res["up"], res["log"]
        print(f"{ray}: serve exited {res['rc']} {res['took_s']} s after SIGTERM to its group; the group was gone "
              f"after {res['group_gone_s']} s")
        assert res["rc"] == 0 and res["took_s"] < STOP_BOUND_S, res
        assert "SIGTERM received: stopping sig64" in res["log"] and "stopped sig64 in" in res["log"], res["log"]
        assert res["rings_while_serving"], res          # the check below looks where the rings were
        assert res["left"] == [] and res["group_left"] == [], res
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def _ours(tmp: str) -> list[str]:
    """This run's rings and doorbells: the namespace's own /dev/shm, and the run's temp folder."""
    return sorted([os.path.join("/dev/shm", n) for n in os.listdir("/dev/shm") if n.startswith("dspark-")]
                  + [os.path.join(tmp, n) for n in os.listdir(tmp) if n.startswith("dspark-")])


def _group(pgid: int) -> list[str]:
    """Processes still in the group (zombies are gone already: only their parents' entries)."""
    out = subprocess.run(["ps", "-o", "stat=,args=", "-g", str(pgid)], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if ln.strip() and not ln.lstrip().startswith("Z")]


def _run(ray: str, ckpt: str, tmp: str) -> dict:
    """Inside the namespace: serve in a new session (with `head`: a `ray start --head --block` in its group), SIGTERM
    to the group once it serves, then what is left."""
    env = dict(os.environ, TMPDIR=tmp, RAY_TMPDIR=tmp, DSPARK_CACHE=os.path.join(tmp, "cache"),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("RAY_ADDRESS", None)
    serve = [sys.executable, "-m", "dspark_ray.cli", "serve", "--checkpoint", ckpt, "--tp", "1", "--name", "sig64",
             "--stop-timeout", str(STOP_BOUND_S)]
    log = os.path.join(tmp, "serve.log")
    out = open(log, "w")
    if ray == "head":          # serve execs in place of the shell that started the head: one group, serve its leader
        port = _free_port()
        ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
        head = f"{ray_bin} start --head --port {port} --num-cpus 2 --disable-usage-stats --block >/dev/null 2>&1 &"
        up = f"until (: >/dev/tcp/127.0.0.1/{port}) 2>/dev/null; do sleep 0.5; done;"
        serve = ["bash", "-c", f'{head} {up} exec "$@"', "bash", *serve, "--address", f"127.0.0.1:{port}"]
    p = subprocess.Popen(serve, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while "STEP endpoint" not in open(log).read() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    res = {"up": "STEP endpoint" in open(log).read(), "rings_while_serving": _ours(tmp)}
    t0 = time.monotonic()
    os.killpg(p.pid, signal.SIGTERM)
    try:
        res["rc"] = p.wait(STOP_BOUND_S + 30)
    except subprocess.TimeoutExpired:
        res["rc"] = None
    res["took_s"] = round(time.monotonic() - t0, 2)
    deadline = time.monotonic() + 60        # Ray's workers end on their own, once their raylet is gone
    while _group(p.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    res.update(left=_ours(tmp), group_left=_group(p.pid), group_gone_s=round(time.monotonic() - t0, 1),
               log=open(log).read())
    return res


if __name__ == "__main__":          # inside the namespace; whatever the run left goes with it
    print(json.dumps(_run(*sys.argv[1:4])))
