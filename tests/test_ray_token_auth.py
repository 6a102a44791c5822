"""Ray's token authentication (issue 63, item 3): against a cluster started by `ray start --head` with Ray 2.60's
defaults (a token in ~/.ray/auth_token, RAY_AUTH_MODE unset: token authentication on), and one started with it off,
fresh drivers run `dspark-ray endpoints`, `status` and `DrafterPool.from_deployment` (which reads the deployment's
token from the cluster) as a user would; without Ray's token they are told where it goes, at once. Without
--address, a host running several clusters is named, not picked from. Each head runs in a home folder of its own
(never the user's ~/.ray), its processes in a session of their own, and is stopped by its own `ray start --block`."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from dspark_ray.protocol import access_token
from dspark_ray.transport.tcp import TcpServer

from test_tcp import FakeFrontEnd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP_TOKEN = access_token.new_token()
RAY_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")


def home_with(ray_token: str | None) -> str:
    """A home folder holding Ray's token where `ray start` and a driver look by default (~/.ray/auth_token)."""
    home = tempfile.mkdtemp(prefix="home-")
    if ray_token is not None:
        access_token.write_token_file(os.path.join(home, ".ray", "auth_token"), ray_token)
    return home


def env_of(home: str, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in RAY_VARS}
    return dict(env, HOME=home, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)


def run(env: dict, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return run(env, "-m", "dspark_ray.cli", *args)


class Head:
    """`ray start --head --block` in a session of its own: "token" as Ray 2.60 starts one by default where it finds
    a token (here in the head's own home folder), "disabled" with RAY_AUTH_MODE=disabled."""

    def __init__(self, mode: str, log_dir):
        import socket
        self.mode, self.home = mode, home_with(access_token.new_token())
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.address = f"127.0.0.1:{s.getsockname()[1]}"
        self.temp = tempfile.mkdtemp(prefix="h-")             # short: Ray's socket paths live under it
        self.log = log_dir / f"head-{mode}.log"
        env = env_of(self.home, **({"RAY_AUTH_MODE": "disabled"} if mode == "disabled" else {}))
        with open(self.log, "w") as out:
            self.p = subprocess.Popen(
                [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head", "--block",
                 f"--port={self.address.rsplit(':', 1)[1]}", f"--temp-dir={self.temp}", "--num-cpus=0",
                 "--include-dashboard=false", "--disable-usage-stats"],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def started(self, deadline: float) -> bool:
        text = self.log.read_text()
        assert self.p.poll() is None and time.monotonic() < deadline, text
        if "Ray runtime started" not in text:
            return False
        assert ("Token authentication is enabled" in text) == (self.mode == "token"), text
        return True

    def stop(self) -> None:
        import shutil
        self.p.send_signal(signal.SIGTERM)           # `ray start --block` stops what it started
        try:
            self.p.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait(10)
        shutil.rmtree(self.temp, ignore_errors=True)
        shutil.rmtree(self.home, ignore_errors=True)


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """Both heads, started at once."""
    log_dir = tmp_path_factory.mktemp("heads")
    made = {m: Head(m, log_dir) for m in ("token", "disabled")}
    try:
        deadline = time.monotonic() + 180
        while not all([h.started(deadline) for h in made.values()]):
            time.sleep(0.2)
        yield made
    finally:
        for h in made.values():
            h.stop()


@pytest.fixture(scope="module", params=["token", "disabled"])
def head(request, heads):
    """(the head's auth mode, its address, a home folder holding its Ray token)."""
    h = heads[request.param]
    return h.mode, h.address, h.home


@pytest.fixture(scope="module")
def deployment(head):
    """A deployment's table in the head's GCS, written by a fresh driver, its one worker a token-checking STEP
    endpoint in this process (the fake front-end of test_tcp.py)."""
    mode, address, home = head
    server = TcpServer(FakeFrontEnd(), token=STEP_TOKEN).start()
    script = textwrap.dedent(f"""
        from dspark_ray.client.endpoints import Directory
        d = Directory({address!r})
        node = next(n for n, info in d.nodes().items() if info["alive"])
        d.publish_deployment("tok", ["tok"], tp=2, device="cpu", auth={{"token": True}})
        d.publish_token("tok", {STEP_TOKEN!r})
        d.publish_worker("tok", state="serving", endpoint="127.0.0.1:{server.port}", node_id=node)
    """)
    p = run(env_of(home), "-c", script)
    assert p.returncode == 0, p.stderr[-3000:]
    yield mode, address, home, server
    server.stop()


def test_endpoints_from_a_fresh_driver_holding_rays_token(deployment):
    mode, address, home, server = deployment
    p = cli(env_of(home), "endpoints", "--address", address, "--name", "tok")
    assert p.returncode == 0 and p.stdout.strip() == f"127.0.0.1:{server.port}", (mode, p.stdout, p.stderr)
    assert "token: in the cluster" in p.stderr and "InvalidAuthToken" not in p.stderr, p.stderr


def test_from_deployment_reads_the_workers_and_the_token_from_the_cluster_and_drafts(deployment):
    mode, address, home, server = deployment
    script = textwrap.dedent(f"""
        import numpy as np
        from dspark_ray.protocol.contract import make_entry
        from dspark_ray.client.pool import DrafterPool
        with DrafterPool.from_deployment({address!r}, "tok", timeout_s=10) as pool:
            pool.hello(client="fresh driver")
            (g,) = pool.acquire(1)
            taps = np.zeros((2, pool.limits.taps_width), np.float16)
            (r,) = pool.step([make_entry(slot=g.slot, generation=g.generation, seed_token=41, token_ids=[1, 2],
                                         taps=taps, n_out=3)], deadline_ms=5000)
            print(r.drafts_array().tolist())
    """)
    p = run(env_of(home), "-c", script)
    assert p.returncode == 0 and p.stdout.strip() == "[42, 43, 44]", (mode, p.stdout, p.stderr[-3000:])
    assert server.counts["unauthorized"] == 0


def test_status_joins_from_a_fresh_driver_and_says_where_the_token_is(deployment):
    """The table names a worker whose front-end is no Ray actor here: `status` joins (a Ray driver), reports it
    gone (exit 3) and where the token is, without an authentication error."""
    mode, address, home, server = deployment
    p = cli(env_of(home), "status", "--address", address, "--name", "tok")
    assert p.returncode == 3 and "tok: GONE" in p.stdout and "token: in the cluster" in p.stdout, \
        (mode, p.stdout, p.stderr[-3000:])
    assert "InvalidAuthToken" not in p.stderr and "Authentication" not in p.stderr, p.stderr[-3000:]


def test_a_driver_without_rays_token_is_told_where_it_goes_at_once(deployment, tmp_path):
    mode, address, _, _ = deployment
    if mode == "disabled":
        pytest.skip("a cluster without token authentication asks for none")
    t = time.monotonic()
    p = cli(env_of(str(tmp_path)), "endpoints", "--address", address, "--name", "tok")
    took = time.monotonic() - t
    assert p.returncode == 1 and "has token authentication and this process holds none of its token" in p.stderr \
        and "`ray get-auth-token` on its head prints it" in p.stderr and "~/.ray/auth_token" in p.stderr, p.stderr
    assert took < 15 and p.stderr.count("InvalidAuthToken") <= 1, (took, p.stderr)


def test_without_an_address_a_host_with_several_clusters_names_them(deployment, ray_cluster):
    """This session's cluster and the head: `status` and `endpoints` name both and join neither."""
    _, address, home, _ = deployment
    port = address.rsplit(":", 1)[1]
    session_port = ray_cluster.get_runtime_context().gcs_address.rsplit(":", 1)[1]
    for cmd in ("status", "endpoints"):
        p = cli(env_of(home), cmd, "--name", "tok")
        assert p.returncode == 1 and "Ray clusters (" in p.stderr and f":{port}" in p.stderr \
            and f":{session_port}" in p.stderr and "--address" in p.stderr, (cmd, p.stdout, p.stderr[-2000:])
