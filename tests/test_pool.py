"""DrafterPool (pool.py): slots over several workers, STEPs sent to all of them before any answer is read, a worker
that dies failing alone. Each worker here is the real front-end logic (`StepService`) behind a real TCP server, in
front of an in-process engine run the way a rank runs it (the batch through its wire encoding); the deployed
workers (Ray actors, rings, rank processes) are in tests/test_deploy_workers.py."""
from __future__ import annotations

import socket
import time

import pytest

from dspark_ray.protocol import contract as C
from dspark_ray.testing import workload
from dspark_ray.client import ClientError
from dspark_ray.rank.engine import RankEngine
from dspark_ray.testing.batches import Driver
from dspark_ray.frontend.step_service import Identity, StepService
from dspark_ray.rank.modes import make_drafter
from dspark_ray.client.pool import DrafterPool
from dspark_ray.transport.tcp import TcpServer

from conftest import EnginePair, step_as_reference, to_entry


class Worker:
    """One worker: StepService + TcpServer; `start()` again on the same port after `stop()` (a restarted
    front-end)."""

    def __init__(self, cfg, ckpt, n_slots: int = 2, delay_s: float = 0.0, config_digest: str | None = None,
                 port: int = 0):
        self.cfg, self.ckpt, self.n_slots, self.delay_s = cfg, ckpt, n_slots, delay_s
        self.config_digest = config_digest or cfg.digest()
        self.port = port
        self.start()

    def start(self) -> "Worker":
        cfg = self.cfg
        engine = RankEngine(make_drafter(cfg, "split", ckpt=self.ckpt), self.n_slots)
        self.service = StepService(Identity("model-m", self.config_digest, 2, cfg.max_model_len),
                                   C.Limits.for_config(cfg, slot_capacity=self.n_slots),
                                   EnginePair(engine, self.delay_s),
                                   window=cfg.sliding_window)
        self.server = TcpServer(self.service, port=self.port).start()
        self.port = self.server.port
        return self

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def held(self) -> int:
        return self.service.status()["slots"]["held"]

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture
def workers(cfg, ckpt):
    made: list[Worker] = []

    def make(n: int, **kw) -> list[Worker]:
        made.extend(Worker(cfg, ckpt, **kw) for _ in range(n))
        return made[-n:]
    yield make
    for w in made:
        w.stop()


def pool_of(ws, **kw) -> DrafterPool:
    pool = DrafterPool([w.endpoint for w in ws], timeout_s=30, **kw)
    pool.hello(client="pool test")
    return pool


@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "shm"])
def test_slots_spread_over_the_workers_and_rounds_equal_the_reference_bit_for_bit(workers, cfg, ckpt, shm):
    ws = workers(3)
    with pool_of(ws, shm=shm) as pool:
        assert all(w.client._ring is not None for w in pool.workers) == shm
        grants = pool.acquire(4)
        # Each slot goes to the worker with the most free slots (ties: the first): 2, 1, 1.
        assert [w.held() for w in ws] == [2, 1, 1]
        assert sorted(pool.worker_of(g.slot) for g in grants) == sorted(w.endpoint for w in ws + ws[:1])
        assert len({g.slot for g in grants}) == 4
        ref = Driver(RankEngine(make_drafter(cfg, "split", ckpt=ckpt), 4))
        for batch in workload.rounds(cfg, seed=5, n_requests=4, n_rounds=8, far_start=900):
            step_as_reference(pool, ref, grants, batch)
        assert [w.service.stats["entries"] for w in ws] == [16, 8, 8]
        assert sorted(pool.release([g.slot for g in grants])) == sorted(g.slot for g in grants)
        assert [w.held() for w in ws] == [0, 0, 0]


def test_a_step_runs_on_its_workers_side_by_side(workers, cfg):
    ws = workers(2, delay_s=0.5)
    with pool_of(ws) as pool:
        grants = pool.acquire(2)
        assert [w.held() for w in ws] == [1, 1]
        (batch,) = workload.rounds(cfg, seed=1, n_requests=2, n_rounds=1)
        t0 = time.monotonic()
        got = pool.step([to_entry(e, g.slot, g.generation) for e, g in zip(batch, grants)], deadline_ms=60_000)
        took = time.monotonic() - t0
        assert [r.code for r in got] == [C.Code.OK, C.Code.OK]
        assert took < 0.9, f"{took:.2f} s: the workers' 0.5 s steps ran one after the other"


def test_a_worker_that_dies_fails_alone_and_is_used_again_once_back(workers, cfg, ckpt):
    ws = workers(2)
    with pool_of(ws, retry_s=0.2) as pool:
        grants = pool.acquire(2)
        ref = Driver(RankEngine(make_drafter(cfg, "split", ckpt=ckpt), 2))
        rounds = workload.rounds(cfg, seed=2, n_requests=2, n_rounds=6, vary_n_out=False)
        step_as_reference(pool, ref, grants, rounds[0])
        ws[1].stop()
        # Worker 1's entry answers UNAVAILABLE naming it; worker 0's runs as if nothing happened.
        want = ref.step(rounds[1])
        got = pool.step([to_entry(e, g.slot, g.generation) for e, g in zip(rounds[1], grants)], deadline_ms=60_000)
        assert got[0].code == C.Code.OK and got[0].drafts == want[0].drafts
        assert got[1].code == C.Code.UNAVAILABLE and ws[1].endpoint in got[1].reason, got[1].reason
        assert [s["down"] is None for s in pool.status()] == [True, False]
        # The slot is gone with its worker: UNAVAILABLE until the engine takes a new one.
        got = pool.step([to_entry(rounds[2][1], grants[1].slot, grants[1].generation)], deadline_ms=60_000)
        assert got[0].code == C.Code.UNAVAILABLE and "lost with worker" in got[0].reason
        # Worker 1 comes back on its endpoint (as a front-end that Ray restarted): the pool's background try
        # finds it, and acquire uses it again.
        ws[1].start()
        until = time.monotonic() + 10
        while pool.status()[1]["down"] is not None and time.monotonic() < until:
            time.sleep(0.05)
        (again,) = pool.acquire(1)
        assert pool.worker_of(again.slot) == ws[1].endpoint and ws[1].held() == 1
        assert again.slot != grants[1].slot         # the same slot of worker 1, in the pool's new session
        assert pool.status()[1]["down"] is None
        got = pool.step([to_entry(rounds[3][1], grants[1].slot, grants[1].generation)], deadline_ms=60_000)
        assert got[0].code == C.Code.UNAVAILABLE and "lost with worker" in got[0].reason   # still the old one
        ref2 = Driver(RankEngine(make_drafter(cfg, "split", ckpt=ckpt), 1))
        for batch in workload.rounds(cfg, seed=9, n_requests=1, n_rounds=3):
            step_as_reference(pool, ref2, [again], batch)


def test_an_unknown_slot_fails_alone(workers, cfg):
    ws = workers(2)
    with pool_of(ws) as pool:
        grants = pool.acquire(2)
        (batch,) = workload.rounds(cfg, seed=4, n_requests=2, n_rounds=1)
        entries = [to_entry(e, g.slot, g.generation) for e, g in zip(batch, grants)]
        entries.append(to_entry(batch[0], pool.stride * 7, 1))         # no such worker
        entries.append(to_entry(batch[0], pool.stride - 1, 1))         # worker 0's, not held by this pool
        got = pool.step(entries, deadline_ms=60_000)
        assert [r.code for r in got] == [C.Code.OK, C.Code.OK, C.Code.BAD_ENTRY, C.Code.BAD_ENTRY]
        assert "not held by this pool" in got[2].reason


def test_acquire_is_all_or_nothing(workers):
    ws = workers(2)
    with pool_of(ws) as pool:
        # More than every worker's slots together, or less than one, can never be granted: a bad request.
        for n, why in ((5, "acquire: n 5 > slot_capacity 2 x 2 workers: can never be granted"),
                       (0, "acquire: n 0 < 1")):
            with pytest.raises(ClientError, match=why) as e:
                pool.acquire(n)
            assert e.value.code == C.Code.BAD_ENTRY
        assert [w.held() for w in ws] == [0, 0]
        # Another client holds worker 1's slots: this pool's plan (one each) fails there, and the share goes to
        # worker 0; asking for more than is free anywhere undoes what was granted.
        other = pool_of(ws[1:])
        other.acquire(2)
        got = pool.acquire(2)
        assert [w.held() for w in ws] == [2, 2] and {pool.worker_of(g.slot) for g in got} == {ws[0].endpoint}
        pool.release([g.slot for g in got])
        with pytest.raises(ClientError) as e:
            pool.acquire(3)
        assert e.value.code == C.Code.OVERLOADED and [w.held() for w in ws] == [0, 2]
        other.close()


def test_a_worker_unreachable_at_hello_is_down_and_the_others_serve(workers):
    (w,) = workers(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    with DrafterPool([dead, w.endpoint], timeout_s=5) as pool:
        pool.hello()
        st = pool.status()
        assert st[0]["down"] and "cannot connect" in st[0]["down"] and st[1]["down"] is None
        grants = pool.acquire(2)
        assert {pool.worker_of(g.slot) for g in grants} == {w.endpoint}


def test_workers_serving_another_model_are_refused(workers, cfg, ckpt):
    (a,) = workers(1)
    (b,) = workers(1, config_digest="f" * 16)
    pool = DrafterPool([a.endpoint, b.endpoint], timeout_s=5)
    with pytest.raises(ClientError, match="serves model") as e:
        pool.hello()
    assert e.value.code == C.Code.CONFIG_MISMATCH
    # Nothing is left open: both workers see their sessions closed.
    until = time.monotonic() + 5
    while (a.service.sessions or b.service.sessions) and time.monotonic() < until:
        time.sleep(0.05)
    assert not a.service.sessions and not b.service.sessions
    assert all(s["down"] for s in pool.status())


def test_a_pool_with_fixed_endpoints_needs_no_ray():
    """An engine that passes endpoints vendors the client and the pool alone: neither imports ray."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['ray'] = None\n"        # an import of ray now raises ImportError
            "from dspark_ray.client.pool import DrafterPool\nfrom dspark_ray.client import DrafterClient\n"
            "DrafterPool(['127.0.0.1:1']).close()\nprint('ok')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]


def test_a_deployment_on_a_cluster_that_does_not_answer_is_refused_within_the_bound():
    """from_deployment asks the cluster's GCS, bounded: no GCS at the address is a ConnectionError in about the
    bound, not Ray's own ~12 s wait."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        nobody = f"127.0.0.1:{port}"
    t = time.monotonic()
    with pytest.raises(ConnectionError, match=rf"GCS at \S+:{port} does not answer"):      # (localhost resolved)
        DrafterPool.from_deployment(nobody, "dspark", resolve_timeout_s=1.0)
    assert time.monotonic() - t < 3.0
