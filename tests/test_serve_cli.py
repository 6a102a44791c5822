"""What an operator meets running `dspark-ray serve` / `stop` (issue 51): a signal tears down everything serve
started and exits 0; output off a terminal is one line per phase, without a warning the operator cannot act on;
`stop` with nothing deployed says so and exits 1. Each command runs as its own process, joined to the session's
Ray cluster, as a user's would be on a `ray start` cluster."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STOP_BOUND_S = 60.0


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "dspark_ray.cli", *args]


def run_cli(ray_cluster, *args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cli(*args, "--address", address(ray_cluster)), cwd=ROOT, env=env or cli_env(),
                          capture_output=True, text=True, timeout=timeout)


def address(ray_cluster) -> str:
    return ray_cluster.get_runtime_context().gcs_address


def cli_env() -> dict:
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rings_of(name: str) -> list[str]:
    """The shared-memory segments and doorbell folders of the worker `name`'s ring (transport/ring.py names) that
    this session's processes made (another test session on the host may serve a worker of the same name)."""
    import tempfile

    from conftest import SESSION_PROCESSES
    from dspark_ray.transport.ring import ring_owner_pid
    ours = SESSION_PROCESSES.look()
    return [f for where in ("/dev/shm", tempfile.gettempdir()) for f in os.listdir(where)
            if f.startswith(f"dspark-{name}-") and ring_owner_pid(f) in ours]


def deployed(ray_cluster, name: str) -> dict:
    """What of the deployment `name` the cluster still holds: named actors, live placement groups, the HTTP app."""
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.util import placement_group_table
    actors = sorted(a["name"] for a in ray_cluster.util.list_named_actors(all_namespaces=True)
                    if a["name"].startswith(f"{name}-"))
    groups = sorted(g["name"] for g in placement_group_table().values()
                    if g.get("name") == f"{name}-pg" and g.get("state") != "REMOVED")
    apps = []
    if _get_global_client(raise_if_no_controller_running=False) is not None:
        apps = [a for a in serve.status().applications if a.startswith(name)]
    return {"actors": actors, "groups": groups, "apps": apps, "rings": rings_of(name)}


NOTHING = {"actors": [], "groups": [], "apps": [], "rings": []}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_tears_down_everything_serve_started_and_exits_0(ray_cluster, tiny_ckpt, sig, tmp_path):
    """`serve` in the foreground with its HTTP app, joined to a cluster (where what it leaves outlives it): SIGTERM
    (systemctl stop) and SIGINT (Ctrl-C) both remove the HTTP app, the front-end and ranks, their placement group,
    the ring and its doorbells, within the bound, and exit 0. Its output, read off a terminal, has one line per
    phase (no progress bar redraws)."""
    from dspark_ray.protocol.access_token import new_token, write_token_file
    name = f"sig{sig.value}"
    http_port = free_port()
    log = tmp_path / "serve.log"
    token_file = write_token_file(tmp_path / "token", new_token())
    try:
        with open(log, "w") as out:
            p = subprocess.Popen(cli("serve", "--checkpoint", str(tiny_ckpt), "--tp", "1", "--name", name,
                                     "--http-port", str(http_port), "--address", address(ray_cluster),
                                     "--stop-timeout", str(STOP_BOUND_S), "--token-file", str(token_file)),
                                 cwd=ROOT, env=cli_env(), stdout=out, stderr=subprocess.STDOUT, text=True)
            deadline = time.monotonic() + 300
            while "serving; Ctrl-C or SIGTERM to stop" not in open(log).read():
                assert p.poll() is None, open(log).read()
                assert time.monotonic() < deadline, open(log).read()
                time.sleep(0.5)
            up = deployed(ray_cluster, name)
            assert up["actors"] == [f"{name}-frontend", f"{name}-rank0"] and up["groups"] == [f"{name}-pg"], up
            assert up["apps"] == [f"{name}-http"] and len(up["rings"]) == 2, up
            t0 = time.monotonic()
            p.send_signal(sig)
            rc = p.wait(STOP_BOUND_S + 30)
            took = time.monotonic() - t0
        text = open(log).read()
        assert rc == 0 and took < STOP_BOUND_S, (rc, took, text)
        assert f"{sig.name} received: stopping {name}" in text and f"stopped {name} in" in text, text
        assert f"token file {token_file} on " in text, text
        assert deployed(ray_cluster, name) == NOTHING
        # one line per phase off a terminal: no carriage-return redraws, the load said once begun and once done
        assert "\r" not in text and text.count("loading the weights on 1 rank(s)") == 1, text
        assert text.count("weights loaded: ") == 1 and "Traceback" not in text, text
    finally:
        from ray import serve
        serve.shutdown()


def test_detached_serve_prints_no_warning_and_stop_removes_it_then_says_nothing_is_left(ray_cluster, tiny_ckpt,
                                                                                         tmp_path):
    """`serve --detach` returns once serving, with no Ray warning the operator cannot act on (the one about
    restartable detached actors in a placement group: docs/operations.md says why it is safe here), having made the
    deployment's token and kept it 0600 where it and `status` say; `stop` removes every worker and exits 0; `stop`
    again has nothing to remove: it says so and exits 1."""
    import stat
    name = "detached"
    env = dict(cli_env(), DSPARK_CACHE=str(tmp_path))
    up = run_cli(ray_cluster, "serve", "--checkpoint", str(tiny_ckpt), "--tp", "1", "--name", name, "--detach",
                 env=env)
    text = up.stdout + up.stderr
    assert up.returncode == 0, text
    assert "restartable detached actor" not in text and "WARNING" not in text and "\r" not in text, text
    assert deployed(ray_cluster, name)["actors"] == [f"{name}-frontend", f"{name}-rank0"]
    kept = tmp_path / "tokens" / name
    assert f"token file {kept} on " in text and stat.S_IMODE(os.stat(kept).st_mode) == 0o600, text
    # the endpoint said once, in serve's own line; the hint names the cluster it joined (issue 64)
    endpoint = text.split("STEP endpoint ", 1)[1].split()[0]
    assert text.count(endpoint) == 1, text
    at = f"--name {name} --address {address(ray_cluster)}"
    assert f"`dspark-ray status {at}` / `dspark-ray stop {at}`" in text, text
    st = run_cli(ray_cluster, "status", "--name", name, env=env)
    assert st.returncode == 0 and f"token file {kept} on " in st.stdout, st.stdout + st.stderr
    assert "  supervisor: not restarting; 0 restart(s) so far" in st.stdout and "{'" not in st.stdout, st.stdout
    down = run_cli(ray_cluster, "stop", "--name", name)
    assert down.returncode == 0 and f"stopped {name}" in down.stdout, down.stdout + down.stderr
    assert deployed(ray_cluster, name) == NOTHING
    again = run_cli(ray_cluster, "stop", "--name", name)
    assert again.returncode == 1 and f"no deployment named {name!r}" in again.stderr, again.stdout + again.stderr


def test_a_serve_killed_outright_leaves_a_stale_entry_that_endpoints_marks_and_stop_removes(ray_cluster, tiny_ckpt,
                                                                                              tmp_path):
    """kill -9 of a `serve` in the foreground: Ray ends the workers it owned, but their endpoint entry stays.
    `endpoints` marks it stale, naming the endpoint, and exits 3; a pool built from the deployment does not take it
    for live; `stop` removes the entry, says so, exits 0, and leaves nothing of the deployment (issue 64)."""
    from dspark_ray.client.pool import DrafterPool
    name = "k64"
    env = dict(cli_env(), DSPARK_CACHE=str(tmp_path))
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        p = subprocess.Popen(cli("serve", "--checkpoint", str(tiny_ckpt), "--tp", "1", "--name", name,
                                 "--address", address(ray_cluster)), cwd=ROOT, env=env, stdout=out,
                             stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 300
        while "serving; Ctrl-C or SIGTERM to stop" not in open(log).read():
            assert p.poll() is None and time.monotonic() < deadline, open(log).read()
            time.sleep(0.5)
        p.kill()
        p.wait(30)
    endpoint = open(log).read().split("STEP endpoint ", 1)[1].split()[0]
    deadline = time.monotonic() + 60           # Ray ends the driver's actors once it sees the driver gone
    while deployed(ray_cluster, name)["actors"] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert deployed(ray_cluster, name)["actors"] == []
    eps = run_cli(ray_cluster, "endpoints", "--name", name, env=env)
    assert eps.returncode == 3 and eps.stdout.strip() == "-", eps.stdout + eps.stderr
    assert f"{name}: stale entry {endpoint}: its front-end (pid " in eps.stderr, eps.stderr
    pool = DrafterPool.from_deployment(address(ray_cluster), name)
    assert [(w["name"], w["endpoint"]) for w in pool.status()] == [(name, None)]
    pool.close()
    down = run_cli(ray_cluster, "stop", "--name", name, env=env)
    assert down.returncode == 0, down.stdout + down.stderr
    assert down.stdout == f"stopped {name}: removed its endpoint entry (its front-end was gone already)\n", down.stdout
    assert deployed(ray_cluster, name) == NOTHING


@pytest.mark.parametrize("args,why", [
    (["--host", "0.0.0.0"], "--host 0.0.0.0 serves beyond this host, to engines that must hold the deployment's "
                            "token: make one with `dspark-ray token --new PATH`"),
    (["--insecure", "--token-file", "x"], "--insecure and --token-file: one or the other"),
    (["--token-file", "/no/such/token"], "token file /no/such/token: No such file or directory"),
])
def test_serve_refuses_to_start_without_a_usable_token_and_says_how_to_make_one(capsys, tiny_ckpt, args, why):
    """Before Ray or the checkpoint is touched: exit 2 and the reason."""
    from dspark_ray.cli import main
    assert main(["serve", "--checkpoint", str(tiny_ckpt), *args]) == 2
    assert why in capsys.readouterr().err


def test_status_says_where_the_token_is_or_that_there_is_none():
    from dspark_ray.cli import token_line
    assert token_line({"token": False, "insecure": True}, "d").startswith("token: NONE (served --insecure)")
    assert token_line({"token": True, "token_file": "/k/t", "host": "h"}, "d").startswith("token file /k/t on h (")
    assert "`dspark-ray token --name d` read it from the cluster" in token_line({"token": True}, "d")
