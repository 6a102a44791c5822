"""A bounded chaos soak: several clients step while random faults strike the pair. Every request gets an answer
(OK or a documented error), no wrong draft is ever returned (each OK answer is checked bit for bit against an
in-process reference of that client's context), and the front-end's resident memory stays flat."""
from __future__ import annotations

import random
import threading
import time


from dspark_ray.actors.placement import teardown
from dspark_ray.client import DrafterClient
from dspark_ray.protocol.contract import Code
from dspark_ray.rank.engine import RankEngine
from dspark_ray.testing.batches import Driver
from dspark_ray.rank.modes import make_drafter

from conftest import deploy_pair
from test_supervision import Request

CLIENTS, STEPS = 3, 90
FAULTS = ["raise", "raise", "raise_early", "kill", "collective_timeout", "stall"]
DOCUMENTED = {Code.OK, Code.INTERNAL, Code.UNAVAILABLE, Code.STALE_GENERATION, Code.DEADLINE}


def test_chaos_soak(ray_cluster, tiny_ckpt, cfg, full_weights):
    fe, host, port = deploy_pair(ray_cluster, tiny_ckpt, "chaos", collective_timeout_s=1.5, step_timeout_s=4.0)
    codes: dict[int, int] = {}
    errors: list[str] = []
    done = threading.Event()
    warm = threading.Barrier(CLIENTS + 1)
    lock = threading.Lock()

    def client(i):
        ref = Driver(RankEngine(make_drafter(cfg, "split", full=full_weights), 1))
        try:
            with DrafterClient(host, port, timeout_s=60) as c:
                c.hello(client=f"chaos {i}")
                q = Request(c, ref, 0, cfg, 100 + i)
                for k in range(STEPS):
                    if k == 10:
                        warm.wait(120)
                    r = q.step()
                    with lock:
                        codes[r.code] = codes.get(r.code, 0) + 1
                    if r.code not in DOCUMENTED:
                        errors.append(f"client {i}: undocumented answer {r.code}: {r.reason}")
                    if r.code == Code.UNAVAILABLE:
                        time.sleep(0.2)
        except Exception as e:          # a wrong draft (assertion in Request.step) or a lost connection
            errors.append(f"client {i}: {type(e).__name__}: {e}")
            if warm.n_waiting:
                warm.abort()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    warm.wait(120)
    rss0 = ray_cluster.get(fe.status.remote())["rss_bytes"]
    rng = random.Random(0)
    injected = []

    def chaos():
        while not done.is_set():
            time.sleep(rng.uniform(1.5, 3.0))
            st = ray_cluster.get(fe.status.remote())
            if st["unavailable"] or done.is_set():
                continue
            kind = rng.choice(FAULTS)
            try:
                ray_cluster.get(fe.set_fault.remote(rng.randrange(2), kind, count=1, seconds=30.0), timeout=10)
                injected.append(kind)
            except Exception:
                pass                          # the rank died meanwhile: the supervisor is on it

    ct = threading.Thread(target=chaos, daemon=True)
    ct.start()
    for t in threads:
        t.join(600)
    done.set()
    ct.join(10)
    st = ray_cluster.get(fe.status.remote())
    teardown("chaos")
    rss1 = st["rss_bytes"]
    restarts = st["supervisor"]["restart_seconds"]
    p99 = sorted(restarts)[max(0, int(len(restarts) * 0.99) - 1)] if restarts else 0.0
    print(f"\nchaos soak: {sum(codes.values())} steps from {CLIENTS} clients, {len(injected)} faults "
          f"({', '.join(injected)}), {st['supervisor']['restarts']} restarts (p99 {p99:.2f} s, all {restarts}), "
          f"answers {{{', '.join(f'{Code(k).name}: {v}' for k, v in sorted(codes.items()))}}}, front-end RSS "
          f"{rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB")
    assert errors == [], errors
    assert sum(codes.values()) == CLIENTS * STEPS
    # Outside the restarts the pair serves: all but the batches a fault hit and the resyncs after it answer OK.
    # (How many steps fall into restarts depends on the host: faults come every 1.5-3 s, a restart takes 3-4 s and a
    # step ~60 ms on the 2-core CI machine, where 86-138 of the 270 answered OK.)
    ok, unavailable = codes.get(Code.OK, 0), codes.get(Code.UNAVAILABLE, 0)
    assert ok >= 0.8 * (CLIENTS * STEPS - unavailable), codes
    assert ok > CLIENTS * STEPS // 4, codes
    assert injected and codes.get(Code.INTERNAL, 0) > 0
    assert rss1 < rss0 * 1.05, (rss0, rss1)
