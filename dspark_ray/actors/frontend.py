"""The front-end actor: owns the step ring, the rank actors of its pair, the STEP endpoint and the supervisor.

`RingPair` is the `Pair` the service drives: one publish into the ring, one wait for every rank's completion
record (bounded: the watchdog), no Ray call. `PairManager` does the Ray part at the edges: create the rank actors
in their placement-group bundles, load, connect, serve; on restart kill them and do it again.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import asdict

from .. import records as M
from ..contract import EntryResult
from ..endpoints import Directory
from ..frontend import PairFailure, PairLate, StepService
from ..keep_warm import REHEARSAL_ENTRIES, KeepWarm
from ..metrics import Exporter
from ..scheduling import pin_thread, process_facts, raise_priority
from ..settings import current as settings
from ..spec import SAFE_ENV, PairSpec
from ..stamps import Stamps, cpu_now, now
from ..transport.ring import RingError, RingTimeout, StepRing, remove_orphans

log = logging.getLogger("dspark_ray.frontend")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ring_slot_bytes(limits) -> int:
    """A ring slot that holds a decode round of the widest batch in place (each entry's seed and accepted drafts:
    up to graphs.STEP_INSERT_ROWS rows of taps): a larger batch spills to a segment of its own, created and
    faulted in per message (~3 MB on the full preset at 16 entries)."""
    from ..graphs import STEP_INSERT_ROWS
    round_bytes = limits.max_entries_per_replay * (STEP_INSERT_ROWS * (2 * limits.taps_width + 4) + 256)
    return max(1 << 20, -(-(round_bytes + 4096) // 4096) * 4096)


class PairManager:
    """The rank actors of one pair and the ring that feeds them."""

    def __init__(self, spec: PairSpec, pg=None, rank_bundles: list[int] | None = None, rank_resources=None,
                 name: str = "dspark", slot_bytes: int = 1 << 20):
        self.spec, self.pg, self.name = spec, pg, name
        self.rank_bundles = rank_bundles or list(range(spec.tp))
        self.rank_resources = rank_resources or {"num_cpus": 0.5}
        self.ring = StepRing.create(f"dspark-{name}", n_readers=spec.tp, slot_bytes=slot_bytes, n_slots=4,
                                    spin_us=spec.spin_us)
        self.ranks: list = []
        self.placement: list[dict] = []    # per rank: its node and cards (RankActor.placement)
        self.progress_cb = None
        self.stamps = Stamps()         # per batch: publish, posting (with the ring seq), completions seen
        self.last_seq: int | None = None
        # Hung-step bound: a collective's own timeout plus slack, so a timed-out collective reports itself
        # ("broken") before the watchdog calls the step hung.
        self.step_bound_s = spec.step_timeout_s or spec.collective_timeout_s * 2 + 5.0
        self.keep_warm = None          # a keep_warm.KeepWarm: the wait for completions rehearses the batch's coding
        # The last batches' shapes (requests, n_out, margins): what a restarted one-card rank captures first.
        self.shapes: collections.deque = collections.deque(maxlen=256)
        # The last start-up's stamps (wall-clock seconds): begun, old ranks gone, actors asked for, loaded,
        # connected, serving (bench/restart.py lays them out beside the ranks' own).
        self.startup: dict[str, float] = {}
        self.checkpoint_files: list[str] = []       # (read ahead on a restart; the front-end sets them)

    def _actor_options(self, r: int) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        opts = dict(self.rank_resources)
        # The ranks read the front-end's settings (settings.py), whatever the node's environment says.
        env = {**SAFE_ENV, **settings().as_env(), "OMP_NUM_THREADS": str(self.spec.torch_threads),
               "PYTHONUNBUFFERED": "1"}
        if self.spec.device.startswith("cuda"):
            # Load every kernel at start-up: a lazy module load can synchronize the context and deadlock against
            # a collective spinning on the same card (CUDA programming guide, lazy loading). Only where such a
            # collective runs: eager loading makes every kernel of every CUDA library part of the context's
            # creation, which a one-card rank's start-up (and its restart) need not wait for. Set either way: a
            # worker would otherwise inherit whatever the node's environment says.
            env["CUDA_MODULE_LOADING"] = "EAGER" if self.spec.backend == "push" else "LAZY"
        opts["runtime_env"] = {"env_vars": env}
        opts["max_restarts"] = 0         # the front-end restarts the pair as a whole, never one rank alone
        opts["name"], opts["namespace"] = self.rank_name(r), "dspark"     # found again by a restarted front-end
        if self.pg is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=self.rank_bundles[r])
        return opts

    def rank_name(self, r: int) -> str:
        return f"{self.name}-rank{r}"

    def kill_leftovers(self, timeout_s: float = 30.0) -> None:
        """Kill rank actors of this pair that outlived their owner (a front-end that died and was restarted), and
        wait until their names are free."""
        import ray
        deadline = time.monotonic() + timeout_s
        for r in range(self.spec.tp):
            while True:
                try:
                    a = ray.get_actor(self.rank_name(r), namespace="dspark")
                except ValueError:
                    break
                ray.kill(a, no_restart=True)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank actor {self.rank_name(r)} still exists after {timeout_s} s")
                time.sleep(0.1)

    def start(self, first: list[tuple[int, int, bool]] | None = None) -> None:
        """Create, load, connect and serve the ranks. `first`: on a restart, the shapes of the last batches (a
        one-card rank captures their graphs first and serves, rank_worker.py)."""
        import ray
        from .rank import rank_actor_class           # (a rank's code: torch, kept out of the front-end's imports)
        Rank = rank_actor_class()
        stamp = self.startup = {"begun": time.time()}
        self.kill_leftovers()
        stamp["old_ranks_gone"] = time.time()
        t0 = time.monotonic()
        self.ranks = [Rank.options(**self._actor_options(r)).remote(asdict(self.spec), r)
                      for r in range(self.spec.tp)]
        stamp["actors_asked"] = time.time()
        loads = [a.load.remote() for a in self.ranks]
        while True:
            done, _ = ray.wait(loads, num_returns=len(loads), timeout=0.25)
            if self.progress_cb:
                self.progress_cb(ray.get([a.progress.remote() for a in self.ranks]))
            if len(done) == len(loads):
                break
        ray.get(loads)
        stamp["loaded"] = time.time()
        init = f"tcp://127.0.0.1:{_free_port()}" if self.spec.tp == 2 else None
        ray.get([a.connect.remote(init, first) for a in self.ranks], timeout=120)
        stamp["connected"] = time.time()
        for r in range(self.spec.tp):
            self.ring.reset_reader(r)
        ray.get([a.serve.remote(self.ring.handle) for a in self.ranks])
        stamp["serving"] = time.time()
        self.placement = ray.get([a.placement.remote() for a in self.ranks], timeout=30)
        log.info("pair %s: %d ranks up in %.2f s (%s)", self.name, self.spec.tp, time.monotonic() - t0,
                 self.spec.backend if self.spec.tp == 2 else "tp1")

    def kill(self) -> None:
        import ray
        for a in self.ranks:
            try:
                ray.kill(a, no_restart=True)
            except Exception:       # already dead
                pass
        self.ranks = []

    def restart(self) -> None:
        # The checkpoint's files back into the page cache now, while the new ranks' processes start (if the host
        # dropped them): their weights are read from memory (weights/staging.py).
        from ..weights.staging import prefetch
        threading.Thread(target=prefetch, args=(self.checkpoint_files,), name="dspark-prefetch", daemon=True).start()
        self.kill()
        self.start(first=sorted(set(self.shapes)) or None)

    def run(self, batch: M.RingBatch, deadline_ns: int | None = None) -> list[EntryResult]:
        """One step through the ring. A missing completion within the bound is a hang (or a death): the ranks
        are killed so nothing stale can answer later, and the supervisor restarts the pair. Still running at
        `deadline_ns`: PairLate, whose resume() waits on (the same bound, counted from the publish)."""
        # Stamps before each hand-off (a stamp taken after one can trail the reader's).
        row = {"publish": now()}
        with self._failing_closed("ring slot"):
            payload = M.encode(batch)
            row["posting"] = now()
            seq = self.ring.publish(payload, timeout_s=self.step_bound_s)
        row["seq"] = seq
        self.shapes.append(batch_shape(batch))
        bound = time.monotonic() + self.step_bound_s
        return self._collect(batch, payload, row, bound, deadline_ns)

    @contextlib.contextmanager
    def _failing_closed(self, waited_for: str):
        """The ring's errors as pair failures, the ranks killed first: a stuck rank must never answer later."""
        try:
            yield
        except RingTimeout as e:
            self.kill()
            raise PairFailure("hung", f"no {waited_for} within the {self.step_bound_s:g} s watchdog: {e}") from None
        except RingError as e:
            self.kill()
            raise PairFailure("broken", str(e)) from None

    def _collect(self, batch: M.RingBatch, payload: bytes, row: dict, bound: float,
                 deadline_ns: int | None, late: bool = False) -> list[EntryResult]:
        seq = row["seq"]
        # A batch past its deadline (the reaper's wait) is waited for asleep: spinning and rehearsing there would
        # hold the GIL against the connection threads that answer the next STEPs by their deadlines.
        wait = dict(spin_us=0.0, idle=None) if late else dict(idle=self.keep_warm)
        with self._failing_closed("completion"):
            while True:
                # Slices of the bound, so a dead or failed rank is noticed within ~0.1 s instead of at the bound,
                # and the caller gets its turn back at its deadline.
                left = bound - time.monotonic()
                if deadline_ns is not None:
                    left = min(left, (deadline_ns - now()) / 1e9)
                try:
                    comps = self.ring.wait_completions(seq, timeout_s=min(0.1, max(0.0, left)), **wait)
                    break
                except RingTimeout:
                    dead = self.ring.dead_readers()
                    if dead:
                        self.kill()
                        raise PairFailure("dead", f"rank(s) {dead} died during step {seq}") from None
                    broken = [r for r, st in self.ring.completed_so_far(seq).items() if st == M.STATUS_BROKEN]
                    if broken:
                        # A rank's latch closed (its collective timed out: the peer is gone, frozen or slow) while
                        # the other is still on the step: the pair is known bad now, not at the watchdog. (A rank
                        # that failed the step with its latch open is waited for: its peer fails alike.)
                        self.kill()
                        raise PairFailure("broken", f"rank(s) {broken} broke on step {seq} while the others "
                                                    f"still ran it") from None
                    if time.monotonic() >= bound:
                        raise
                    if deadline_ns is not None and now() >= deadline_ns:
                        raise PairLate(lambda: self._collect(batch, payload, row, bound, None, late=True)) from None
        statuses = [s for s, _ in comps]
        if any(s == M.STATUS_BROKEN for s in statuses) or any(s == M.STATUS_STEP_FAILED for s in statuses):
            kind = "broken" if M.STATUS_BROKEN in statuses else "step"
            errs = "; ".join(f"rank {r}: {M.decode_reply(p).error}" for r, (s, p) in enumerate(comps) if s)
            raise PairFailure(kind, errs)
        row["completions"], row["cpu_completions"] = now(), cpu_now()
        results = M.decode_reply(comps[0][1]).results
        self.last_seq = seq
        self.stamps.add(row)
        if self.keep_warm is not None and self.keep_warm.wants_sample("batch", len(payload)):
            sample = batch.head(REHEARSAL_ENTRIES)      # (keep_warm.py)
            self.keep_warm.set("batch", lambda: M.encode(sample))
            self.keep_warm.set("reply", lambda reply=comps[0][1]: M.decode_reply(reply))
        return results

    def status(self) -> list[dict]:
        import ray
        out = []
        for r, a in enumerate(self.ranks):
            try:
                out.append(ray.get(a.status.remote(), timeout=2))
            except Exception as e:
                out.append({"rank": r, "error": f"{type(e).__name__}: {e}"})
        return out

    def close(self) -> None:
        self.kill()
        self.ring.unlink()


def batch_shape(batch: M.RingBatch) -> tuple[int, int, bool]:
    """A batch as the ranks' graphs key it: its requests, the widest n_out, whether any entry wants margins."""
    es = batch.entries
    return len(es), max((e.n_out for e in es), default=0), any(e.want_margins for e in es)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def frontend_actor_class():
    import ray

    @ray.remote(max_concurrency=8)
    class FrontEnd:
        """A thin shell: a StepService + Supervisor fed by a PairManager, served over TCP."""

        def __init__(self, spec: dict, host: str = "127.0.0.1", port: int = 0, name: str = "dspark",
                     pg=None, rank_bundles=None, rank_resources=None, restart_threshold: int = 3):
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
            # A thread woken to answer a STEP by its deadline takes the GIL within 0.5 ms of asking, not the default
            # 5 ms, whatever another thread of the front-end is running.
            sys.setswitchinterval(0.0005)
            import ray
            from ..config import load_config
            from ..contract import Limits
            from ..frontend import Identity
            from ..supervisor import Supervisor
            from ..transport.tcp import TcpServer
            from ..weights.loader import Checkpoint
            self.spec = PairSpec(**spec)
            log.info("front-end %s: %s", name, settings().describe())
            gone = remove_orphans()
            if gone:
                log.warning("front-end %s: removed %d ring(s) their dead owners left: %s", name, len(gone),
                            ", ".join(gone))
            ck = Checkpoint(self.spec.checkpoint)
            cfg = load_config(self.spec.checkpoint)
            self.identity = Identity(ck.identity_digest, cfg.digest(), self.spec.tp, cfg.max_model_len)
            self.limits = Limits.for_config(cfg, slot_capacity=self.spec.n_slots,
                                            max_entries_per_replay=self.spec.batch_limit(cfg))
            self.manager = PairManager(self.spec, pg, rank_bundles, rank_resources, name,
                                       slot_bytes=ring_slot_bytes(self.limits))
            self.manager.checkpoint_files = ck.files()
            # The endpoint's threads rehearse the last STEP's host path while they wait (keep_warm.py).
            self.keep_warm = KeepWarm(f"front-end {name}")
            self.manager.keep_warm = self.keep_warm if self.keep_warm.enabled else None
            self.service = StepService(self.identity, self.limits, None, window=cfg.sliding_window)
            self.supervisor = Supervisor(self.service, self.manager.restart, threshold=restart_threshold)
            cpus = self.spec.frontend_cpus
            self.node_ip = ray.util.get_node_ip_address()
            self.node_id = ray.get_runtime_context().get_node_id()
            self.host, self.name = host, name
            self.directory = Directory(ray.get_runtime_context().gcs_address)
            reconstructed = ray.get_runtime_context().was_current_actor_reconstructed
            for p in self._ports(port, reconstructed):
                try:
                    self.server = TcpServer(self.service, host=host, port=p, spin_us=self.spec.spin_us,
                                            on_thread_start=lambda: pin_thread(cpus, f"front-end {name} endpoint"),
                                            keep_warm=self.keep_warm, advertise=self.node_ip,
                                            max_connections=self.spec.max_connections,
                                            idle_timeout_s=self.spec.idle_timeout_s)
                    break
                except OSError as e:
                    if not reconstructed or p == 0:
                        raise
                    log.warning("front-end %s: port %d is taken on node %s (%s): serving on a free one; clients "
                                "that named the deployment find it", name, p, self.node_ip, e)
            self._publish("starting")
            self.started = False
            self.load_progress = []
            # Prometheus metrics, exported by a thread of their own every second (metrics.py).
            self.metrics = Exporter(name, self.service, self.supervisor, self.server).start()
            if reconstructed:
                # Ray restarted this front-end after it died: whatever is left of the old pair is killed (by
                # name, in start) and a new pair is brought up: on the same endpoint on the node it served on, else
                # where `_ports` found room (the endpoint table tells clients).
                log.warning("front-end %s was restarted by Ray: recreating its pair", name)
                # The old generation died with the old process; a clock-based one is still new to every client.
                self.service.worker_generation = int(time.time())
                import threading
                threading.Thread(target=self.start, name="dspark-recover", daemon=True).start()

        def start(self) -> str:
            """Bring the pair up and open the endpoint; returns "host:port"."""
            if self.started:
                return self.server.endpoint
            self.manager.progress_cb = lambda p: setattr(self, "load_progress", p)
            self.manager.start()
            self.service.pair = self.manager
            self.service.unavailable = None
            # The accept thread starts from this one and its connection threads from it: they inherit niceness 0.
            raise_priority(f"front-end {self.name} endpoint")
            self.server.start()
            self.started = True
            self._publish("serving")
            log.info("front-end %s serving STEP on %s (tp %d, %d slots, model %s)", self.name,
                     self.server.endpoint, self.spec.tp, self.spec.n_slots, self.identity.model_digest)
            return self.server.endpoint

        def _ports(self, port: int, reconstructed: bool) -> list[int]:
            """The ports to try, in order: the port asked for (0: a free one). After Ray restarted this front-end,
            first the port it served on if that was on this node (a fixed-endpoint client finds it again), and a
            free one last: the deployment's table tells clients where it is."""
            if not reconstructed:
                return [port]
            try:
                last = self.directory.workers_by_name([self.name]).get(self.name) or {}
            except ConnectionError as e:
                log.warning("front-end %s: the endpoint table does not answer: %s", self.name, e)
                last = {}
            first = [last["port"]] if last.get("node_id") == self.node_id and last.get("port") else []
            return list(dict.fromkeys(first + [port, 0]))

        def _publish(self, state: str) -> None:
            """This worker's entry in the endpoint table (endpoints.py): where it serves, or that it is starting."""
            try:
                self.directory.publish_worker(
                    self.name, state=state, endpoint=self.server.endpoint if state == "serving" else None,
                    host=self.host, port=self.server.port, node_id=self.node_id, node_ip=self.node_ip,
                    cards=[p["cards"] for p in self.manager.placement], tp=self.spec.tp, pid=os.getpid())
            except ConnectionError as e:        # the table is for finding workers; serving goes on without it
                log.warning("front-end %s: endpoint table not updated (%s): %s", self.name, state, e)

        def endpoint(self) -> str:
            return self.server.endpoint

        def node(self) -> str:
            """The IP address of the node this front-end runs on."""
            return self.node_ip

        def progress(self):
            return self.load_progress

        def status(self) -> dict:
            return {"rss_bytes": _rss_bytes(), "process": process_facts(), "name": self.name,
                    "endpoint": self.server.endpoint if self.started else None, "node_ip": self.node_ip,
                    "node_id": self.node_id, "cards": [p["cards"] for p in self.manager.placement],
                    "tp": self.spec.tp, "backend": self.spec.backend, "model_digest": self.identity.model_digest,
                    "max_batch": self.limits.max_entries_per_replay,
                    "pid": os.getpid(), "env": {k: os.environ.get(k) for k in SAFE_ENV},
                    "settings": settings().to_dict(),
                    **self.service.status(), "supervisor": self.supervisor.status(),
                    "keep_warm": self.keep_warm.status(),
                    "wake_ups": self.server.wake_ups.status(),
                    "startup": self.manager.startup,
                    "ranks": self.manager.status()}

        def set_fault(self, rank: int, kind: str | None, **params) -> str:
            import ray
            msg = ray.get(self.manager.ranks[rank].set_fault.remote(kind, **params))
            log.warning("fault injection: %s", msg)
            return msg

        def stamps(self) -> dict:
            """Recent per-step stamps of every party behind this endpoint (bench/step_latency.py joins them)."""
            import ray
            return {"tcp": self.server.stamps.recent(), "service": self.service.stamps.recent(),
                    "ring": self.manager.stamps.recent(),
                    "ranks": ray.get([a.stamps.remote() for a in self.manager.ranks], timeout=10)}

        def rank_pids(self) -> list[int]:
            return [s.get("pid") for s in self.manager.status()]

        def shutdown(self) -> None:
            try:
                self.directory.remove_worker(self.name)
            except ConnectionError as e:
                log.warning("front-end %s: its endpoint table entry stays: %s", self.name, e)
            self.server.stop()
            self.metrics.stop()
            self.manager.close()
            log.info("front-end %s stopped", self.name)

    return FrontEnd
