"""Shared fixtures: one tiny synthetic checkpoint per session, its full weights, and a CPU-friendly torch."""
from __future__ import annotations

import contextlib
import fnmatch
import os
import shutil
import tempfile
import threading
import time

import msgspec
import pytest
import torch

# The model's results do not depend on the thread count (pinned reduction order), but its many small ops run
# several times slower with two threads fighting over this 2-core machine's cores.
torch.set_num_threads(1)
os.environ.setdefault("RAY_ACCEPT_CALLBACKS", "0")
# The deployed parties rehearse their step path at every poll of their waits (keep_warm.py; in service at most every
# 100 us, which a CPU host's 50 us spins never reach): every answer the Ray tests check then follows rehearsals.
# Set before dspark_ray is imported: its settings are read once, and the front-end hands them to every actor.
os.environ.setdefault("DSPARK_KEEP_WARM_US", "0")
os.environ.setdefault("DSPARK_KEEP_WARM_HOLD_US", "0")      # from the step's end on, not 250 us after it
# Ray prints what it tells the driver (a worker killed on purpose: "(raylet) A worker died ...") in ANSI colours,
# which land raw in the suite's summary off a terminal; 0 keeps them plain (read by this process's Ray at each print).
os.environ.setdefault("RAY_COLOR_PREFIX", "0")

from dspark_ray.protocol import records as M  # noqa: E402
from dspark_ray.protocol.contract import Code  # noqa: E402


# ---- what the session leaves behind --------------------------------------------------------------------------------
# A test leaves no shared-memory segment and no temp file. The session's temp folder is one made here (TMPDIR, for
# this process and all it starts: Ray's workers, the CLI's processes): pytest's tmp_path folders and Ray's session
# (RAY_TMPDIR; its address file too, so `ray.init(address="auto")` in a test finds this session's cluster only)
# live in it, and anything else left in it at the end fails the run (pytest_sessionfinish), as does a name new in
# /dev/shm, or a name of ours new in the host's temp folder (written there directly), that one of the session's own
# processes made: the pid in its name (a ring's "<prefix>-<pid>-<hex>", the pattern every segment of ours follows)
# is one of theirs (SessionProcesses). Another deployment or test session on the host makes names of the same kinds;
# a name without a pid cannot be told apart, and is not counted. Then the folder goes.
HOST_TMP = tempfile.gettempdir()
SESSION_TMP = tempfile.mkdtemp(prefix="dsr-tests-")      # short: Ray's socket paths live under it
OURS = ("dsr-*", "dr-*", "dspark*", "*.bells")            # names our code and tests give, in the host's temp folder
SESSION_OWN = ("pytest", "ray", "ray-auth-token")         # pytest's and Ray's, in the session's folder


class SessionProcesses:
    """The pids of the session's processes: pytest and every process started under it, Ray's daemons and workers
    too (each inherits `MARK` in its environment). A thread looks for new ones every `period_s`, since the names a
    process made outlive it; each one's pids in inner PID namespaces (tests/test_readme.py) count too."""

    MARK = "DSPARK_TEST_SESSION"

    def __init__(self, token: str, period_s: float = 0.2):
        os.environ[self.MARK] = token
        self._mark = f"{self.MARK}={token}".encode()
        self.pids = {os.getpid()}
        self._looked: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._watch, args=(period_s,), name="dsr-session-pids", daemon=True).start()

    def _watch(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            self.look()

    def look(self) -> set[int]:
        """Take in the session's processes running now; the pids seen so far."""
        with self._lock:
            for pid in [int(n) for n in os.listdir("/proc") if n.isdigit()]:
                if pid not in self._looked:
                    self._looked.add(pid)
                    if self._mark in _read(f"/proc/{pid}/environ").split(b"\0"):
                        self.pids.update(_ns_pids(pid))
            return set(self.pids)

    def stop(self) -> set[int]:
        self._stop.set()
        return self.look()


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:                         # gone meanwhile, or not ours to read
        return b""


def _ns_pids(pid: int) -> set[int]:
    """`pid` and its pids in the PID namespaces below this one ("NSpid:" of /proc/<pid>/status)."""
    for line in _read(f"/proc/{pid}/status").decode(errors="replace").splitlines():
        if line.startswith("NSpid:"):
            return {int(p) for p in line.split()[1:]}
    return {pid}


def listing(places) -> dict[str, set[str]]:
    return {p: set(os.listdir(p)) if os.path.isdir(p) else set() for p in places}


def left_behind(before: dict[str, set[str]], only: tuple[str, ...] = ("*",), pids: set[int] | None = None
                ) -> list[str]:
    """The paths new since `before` whose names match a glob of `only` (and, given `pids`, were made by one of them:
    the creator's pid in a name of the rings' pattern, transport/ring.py)."""
    from dspark_ray.transport.ring import ring_owner_pid
    return sorted(os.path.join(p, n) for p, names in listing(tuple(before)).items() for n in names - before[p]
                  if any(fnmatch.fnmatch(n, g) for g in only) and (pids is None or ring_owner_pid(n) in pids))


BEFORE_SHM, BEFORE_HOST = listing(["/dev/shm"]), listing([HOST_TMP])
SESSION_PROCESSES = SessionProcesses(SESSION_TMP)
os.environ["TMPDIR"] = SESSION_TMP
tempfile.tempdir = SESSION_TMP
os.environ.setdefault("RAY_TMPDIR", SESSION_TMP)
# Ray 2.60 starts every ray.init() cluster with token authentication and, finding no token, writes one to
# ~/.ray/auth_token, where every later `ray start --head` of this user finds it. The session's token is its own.
if "RAY_AUTH_TOKEN" not in os.environ and "RAY_AUTH_TOKEN_PATH" not in os.environ:
    from dspark_ray.protocol.access_token import new_token, write_token_file  # noqa: E402
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(write_token_file(os.path.join(SESSION_TMP, "ray-auth-token"),
                                                             new_token()))


def pytest_configure(config):
    if not config.option.basetemp:
        config.option.basetemp = os.path.join(SESSION_TMP, "pytest")


LEFT_BEHIND: list[str] = []


def pytest_sessionfinish(session, exitstatus):
    pids = SESSION_PROCESSES.stop()
    LEFT_BEHIND[:] = left_behind(BEFORE_SHM, pids=pids) + left_behind(BEFORE_HOST, OURS, pids) + \
        sorted(os.path.join(SESSION_TMP, n) for n in set(os.listdir(SESSION_TMP)) - set(SESSION_OWN))
    shutil.rmtree(SESSION_TMP, ignore_errors=True)
    if LEFT_BEHIND:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if LEFT_BEHIND:
        terminalreporter.section("left behind by this session (shared memory or temp files)", red=True)
        for path in LEFT_BEHIND:
            terminalreporter.write_line(f"  {path}", red=True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    from dspark_ray.config import tiny
    from dspark_ray.weights.synth import synthesize
    out = tmp_path_factory.mktemp("tiny_ckpt")
    synthesize(tiny(), out, seed=0)
    return out


@pytest.fixture(scope="session")
def ckpt(request):
    """The tiny synthetic drafter, or the checkpoint DSPARK_TEST_CKPT names (the GPU machine's full preset:
    `DSPARK_TEST_CKPT=/tmp/full pytest tests/test_gpu_graphs.py -k "set and fast"` runs the graph set's bit checks,
    batch invariance included, at the full shapes, where the kernels' measured tiles apply)."""
    from dspark_ray.weights.loader import Checkpoint
    path = os.environ.get("DSPARK_TEST_CKPT")
    return Checkpoint(path or request.getfixturevalue("tiny_ckpt"))


@pytest.fixture(scope="session")
def cfg(ckpt):
    return ckpt.config


@pytest.fixture(scope="session")
def full_weights(ckpt):
    """The whole model in compute form (read once; tests that plant ties copy what they change)."""
    return {n: ckpt.read(n) for n in ckpt.names()}


def _start_local_ray() -> None:
    import logging

    import ray
    # The CPU machine's 2 cores; a GPU host gives the pair's bundles ({GPU 1, CPU 1} x 2 + the front-end's) room.
    cpus = 2 if PAIR_BACKEND == "gloo" else max(4, min(8, os.cpu_count() or 4))
    ray.init(num_cpus=cpus, include_dashboard=False, namespace="dspark", log_to_driver=False,
             logging_level=logging.WARNING)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray instance for every test that needs real actors (keeps the suite fast on 2 cores)."""
    import ray
    _start_local_ray()
    yield ray
    ray.shutdown()


@contextlib.contextmanager
def without_the_shared_ray():
    """For a test that runs a Ray cluster of its own (a driver joins one cluster at a time): the shared local Ray
    stops for it, and starts again after it if it ran."""
    import ray
    was = ray.is_initialized()
    ray.shutdown()
    try:
        yield
    finally:
        ray.shutdown()
        if was:
            _start_local_ray()


# DSPARK_TEST_PAIR=push (on a two-card GPU host) runs the Ray deployment tests on the real pair: one card per rank,
# the NVLink push collectives, CUDA graphs, and the exact matmul (so the in-process CPU reference still matches bit
# for bit). Default: gloo ranks on the CPU.
PAIR_BACKEND = os.environ.get("DSPARK_TEST_PAIR", "gloo")


def deploy_pair(ray_cluster, ckpt_dir, name, **kw):
    """Deploy a tiny pair on the shared cluster; returns (front-end handle, host, port)."""
    from dspark_ray.actors.placement import deploy
    from dspark_ray.spec import PairSpec
    gpu = dict(backend="push", device="cuda", matmul="exact") if PAIR_BACKEND == "push" else {}
    spec = PairSpec(checkpoint=str(ckpt_dir), tp=kw.pop("tp", 2), n_slots=kw.pop("n_slots", 8),
                    collective_timeout_s=kw.pop("collective_timeout_s", 3.0),
                    step_timeout_s=kw.pop("step_timeout_s", None), rank_cpus=kw.pop("rank_cpus", None),
                    frontend_cpus=kw.pop("frontend_cpus", None), max_batch=kw.pop("max_batch", 6),
                    markov_cache=kw.pop("markov_cache", "auto"), **gpu)
    fe, endpoint = deploy(spec, name=name, **kw)
    host, port = endpoint.rsplit(":", 1)
    return fe, host, int(port)


def flip_stored_byte(file, name: str, offset: int) -> None:
    """Flip the low bit of byte `offset` of tensor `name`'s stored bytes in the safetensors `file` (a damaged
    checkpoint for the identity checks)."""
    from dspark_ray.weights.manifest import scan_safetensors
    t = next(t for t in scan_safetensors(file) if t.name == name)
    with open(file, "r+b") as f:
        f.seek(t.begin + offset)
        b = f.read(1)
        f.seek(t.begin + offset)
        f.write(bytes([b[0] ^ 1]))


# ---- STEPs against the in-process reference (the deployment and pool tests) -------------------------------------
class EnginePair:
    """A worker's pair in this process (frontend.Pair): the rank loop's decode, step and encode (rank/worker.py)
    around one engine; `delay_s` stands for a slow step."""

    def __init__(self, engine, delay_s: float = 0.0):
        self.engine, self.delay_s = engine, delay_s

    def run(self, batch, deadline_ns=None):
        time.sleep(self.delay_s)
        results = self.engine.step(M.decode_batch(M.encode(batch)))
        return M.decode_reply(M.encode(M.RingReply(results))).results


def to_entry(e, slot, gen, **over):
    """A workload entry (generation 0, request i on slot i) sent for a granted slot."""
    return msgspec.structs.replace(e, slot=slot, generation=gen, **over)


def step_as_reference(c, ref, grants, batch) -> None:
    """One STEP of `batch` (request i on grants[i]) over the wire: every answer OK and the in-process reference's
    (a `dspark_ray.testing.batches.Driver`) bit for bit."""
    want = ref.step(batch)
    got = c.step([to_entry(e, grants[i].slot, grants[i].generation) for i, e in enumerate(batch)], deadline_ms=60_000)
    for w, g in zip(want, got):
        assert g.code == Code.OK, g.reason
        assert (g.drafts, g.confidences, g.margins, g.confident_len) == \
            (w.drafts, w.confidences, w.margins, w.confident_len)


def assert_set_drafts_like_eager(gs, d, eager, block_size: int, seed0: int, seed_step: int) -> None:
    """At 1..4 requests (the graph set's first slots, filled like `eager`'s slots), the set's draft with margins
    equals the eager drafter's bit for bit, every field."""
    for bsz in range(1, 5):
        seeds = [seed0 + seed_step * r for r in range(bsz)]
        got = gs.run([], gs.slots[:bsz], seeds, block_size, True)
        want = d.draft(eager[:bsz], seeds, block_size, True)
        for k in ("drafts", "confidences", "confident_len", "margins"):
            assert torch.equal(getattr(got, k), getattr(want, k).cpu()), (bsz, k)


@pytest.fixture(autouse=True)
def _settings_from_the_environment():
    """A test that changes a DSPARK_* knob re-reads the settings itself (settings.reread()); whatever it changed is
    read back from the restored environment after it."""
    yield
    from dspark_ray import settings
    settings.reread()
