"""The front-end actor: owns the step ring, its pair's rank actors, the STEP endpoint and the supervisor. Per step
no Ray call: the service drives the pair through a `RingDriver`; `PairLauncher` does the Ray part at the edges.
"""
from __future__ import annotations

import logging
import os
import sys
import time

from ..client.endpoints import Directory
from ..observe.keep_warm import KeepWarm, step_checks
from ..observe.metrics import Exporter
from ..observe.recorders import DriverRecorder, ServerRecorder, ServiceRecorder
from ..protocol.records import ring_slot_bytes
from ..frontend.ring_driver import RingDriver
from ..scheduling import pin_thread, process_facts, raise_priority
from ..settings import current as settings
from ..spec import SAFE_ENV, PairSpec
from ..frontend.step_service import StepService
from ..transport.ring import StepRing, remove_orphans
from .pair import PairLauncher

log = logging.getLogger("dspark_ray.frontend")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# A front-end that dies on a live node is restarted by Ray at most this many times; a restart after its node was
# lost is not counted (Ray's own max_restarts counts both: a deployment lost its workers after 4 lost nodes).
OWN_RESTARTS = 3


def own_failures(last: dict, nodes: dict) -> int:
    """A restarted front-end's own deaths so far, the one it was restarted after included unless its node was lost:
    from its previous process's entry (`last`, {} when none was read) and the cluster's nodes (Directory.nodes)."""
    before = int(last.get("own_failures", 0))
    node = nodes.get(last.get("node_id") or "")
    return before if node is not None and not node["alive"] else before + 1


def frontend_actor_class():
    import ray

    @ray.remote(max_concurrency=8)
    class FrontEnd:
        def __init__(self, spec: dict, host: str = "127.0.0.1", port: int = 0, name: str = "dspark",
                     pg=None, rank_bundles=None, rank_resources=None, restart_threshold: int = 3,
                     token: str | None = None):
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
            # A thread woken to answer a STEP by its deadline gets the GIL within 0.5 ms, not 5.
            sys.setswitchinterval(0.0005)
            import ray
            from ..config import load_config
            from ..protocol.contract import Limits
            from ..frontend.step_service import Identity
            from ..frontend.supervisor import Supervisor
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
            self.ring = StepRing.create(f"dspark-{name}", n_readers=self.spec.tp,
                                        slot_bytes=ring_slot_bytes(self.limits), n_slots=4, spin_us=self.spec.spin_us)
            self.pair = PairLauncher(self.spec, self.ring, pg, rank_bundles, rank_resources, name)
            self.pair.checkpoint_files = ck.files()
            # Past a collective's own timeout, so a timed-out collective reports "broken" before the step is "hung".
            step_bound_s = self.spec.step_timeout_s or self.spec.collective_timeout_s * 2 + 5.0
            self.keep_warm = KeepWarm(f"front-end {name}")
            self.recorders = {"service": ServiceRecorder(), "ring": DriverRecorder(self.keep_warm)}
            self.driver = RingDriver(self.ring, step_bound_s, on_fail=self.pair.kill)
            self.recorders["ring"].seam(self.driver)
            self.service = StepService(self.identity, self.limits, None, window=cfg.sliding_window,
                                       observer=self.recorders["service"])
            self.recorders["tcp"] = ServerRecorder(f"front-end {name} endpoint", self.spec.spin_us, self.keep_warm,
                                                   checks=step_checks(self.limits))
            # A restarted one-card rank captures the last batches' shapes first.
            self.supervisor = Supervisor(self.service, lambda: self.pair.restart(self.driver.recent_shapes()),
                                         threshold=restart_threshold)
            cpus = self.spec.frontend_cpus
            self.node_ip = ray.util.get_node_ip_address()
            self.node_id = ray.get_runtime_context().get_node_id()
            self.actor_id = ray.get_runtime_context().get_actor_id()   # readers of its entry check it lives
            self.host, self.name = host, name
            self.directory = Directory(ray.get_runtime_context().gcs_address)
            reconstructed = ray.get_runtime_context().was_current_actor_reconstructed
            last = self._last_entry() if reconstructed else {}
            # Restarted on another node: Ray moves a placement group only when its node dies (`status` says so).
            self.moved_from = ({"node_id": last["node_id"], "node_ip": last.get("node_ip")}
                               if last.get("node_id") not in (None, self.node_id) else None)
            self.own_failures = own_failures(last, self._nodes()) if reconstructed else 0
            if self.own_failures > OWN_RESTARTS:
                self._give_up(pg)
                return
            for p in self._ports(port, last):
                try:
                    self.server = TcpServer(self.service, host=host, port=p, spin_us=self.spec.spin_us,
                                            on_thread_start=lambda: pin_thread(cpus, f"front-end {name} endpoint"),
                                            observer=self.recorders["tcp"], advertise=self.node_ip,
                                            max_connections=self.spec.max_connections,
                                            idle_timeout_s=self.spec.idle_timeout_s, token=token)
                    break
                except OSError as e:
                    if not reconstructed or p == 0:
                        raise
                    log.warning("front-end %s: port %d is taken on node %s (%s): serving on a free one; clients "
                                "that named the deployment find it", name, p, self.node_ip, e)
            self._publish("starting")
            self.started = False
            self.load_progress = []
            self.metrics = Exporter(name, self.service, self.supervisor, self.server).start()
            if reconstructed:
                # Ray restarted this front-end: start() kills what is left of the old pair by name.
                log.warning("front-end %s was restarted by Ray: recreating its pair", name)
                # The old generation died with the old process; a clock-based one is still new to every client.
                self.service.worker_generation = int(time.time())
                import threading
                threading.Thread(target=self.start, name="dspark-recover", daemon=True).start()

        def start(self) -> str:
            if self.started:
                return self.server.endpoint
            self.pair.progress_cb = lambda p: setattr(self, "load_progress", p)
            self.pair.start()
            self.service.pair = self.driver
            self.service.unavailable = None
            # The endpoint's threads start from this one and inherit niceness 0.
            raise_priority(f"front-end {self.name} endpoint")
            self.server.start()
            self.started = True
            self._publish("serving")
            log.info("front-end %s serving STEP on %s (tp %d, %d slots, model %s; %s)", self.name,
                     self.server.endpoint, self.spec.tp, self.spec.n_slots, self.identity.model_digest,
                     "HELLO needs the deployment's token" if self.server.token is not None
                     else "no token: whoever reaches the endpoint may HELLO")
            return self.server.endpoint

        def _last_entry(self) -> dict:
            """The entry the previous process of this front-end left in the table ({} when none is to be read)."""
            try:
                return self.directory.workers_by_name([self.name]).get(self.name) or {}
            except ConnectionError as e:
                log.warning("front-end %s: the endpoint table does not answer: %s", self.name, e)
                return {}

        def _nodes(self) -> dict:
            try:
                return self.directory.nodes()
            except ConnectionError as e:
                log.warning("front-end %s: the node table does not answer: %s", self.name, e)
                return {}

        def _ports(self, port: int, last: dict) -> list[int]:
            """Ports to try. After a Ray restart (`last`: the previous process's entry), first the one served on, if
            on this node (a fixed-endpoint client finds it again), and a free one last (the table tells clients)."""
            if not last:
                return [port]
            first = [last["port"]] if last.get("node_id") == self.node_id and last.get("port") else []
            return list(dict.fromkeys(first + [port, 0]))

        def _give_up(self, pg) -> None:
            """Past its own restart budget: say so in its entry and the log, and hand itself and its placement
            group to a helper that ends both for good (release.py)."""
            from .release import release_worker
            why = (f"gave up after its front-end died {self.own_failures} times on a live node (Ray restarts it "
                   f"{OWN_RESTARTS} times; a lost node does not count): its placement group was released")
            log.error("front-end %s %s", self.name, why)
            self.ring.unlink()
            try:
                self.directory.publish_worker(self.name, state="gave up", why=why, endpoint=None,
                                              node_id=self.node_id, node_ip=self.node_ip, pid=os.getpid(),
                                              actor_id=self.actor_id, own_failures=self.own_failures)
            except ConnectionError as e:
                log.warning("front-end %s: endpoint table not updated (gave up): %s", self.name, e)
            release_worker(self.name, pg)

        def _publish(self, state: str) -> None:
            try:
                self.directory.publish_worker(
                    self.name, state=state, endpoint=self.server.endpoint if state == "serving" else None,
                    host=self.host, port=self.server.port, node_id=self.node_id, node_ip=self.node_ip,
                    cards=[p["cards"] for p in self.pair.placement], tp=self.spec.tp, pid=os.getpid(),
                    moved_from=self.moved_from, actor_id=self.actor_id,
                    own_failures=self.own_failures)
            except ConnectionError as e:        # the table is for finding workers; serving goes on without it
                log.warning("front-end %s: endpoint table not updated (%s): %s", self.name, state, e)

        def endpoint(self) -> str:
            return self.server.endpoint

        def node(self) -> str:
            return self.node_ip

        def progress(self):
            return self.load_progress

        def status(self) -> dict:
            return {"rss_bytes": _rss_bytes(), "process": process_facts(), "name": self.name,
                    "endpoint": self.server.endpoint if self.started else None, "node_ip": self.node_ip,
                    "node_id": self.node_id, "cards": [p["cards"] for p in self.pair.placement],
                    "tp": self.spec.tp, "backend": self.spec.backend, "model_digest": self.identity.model_digest,
                    "token_required": self.server.token is not None,
                    "max_batch": self.limits.max_entries_per_replay,
                    "pid": os.getpid(), "env": {k: os.environ.get(k) for k in SAFE_ENV},
                    "settings": settings().to_dict(),
                    **self.service.status(), "supervisor": self.supervisor.status(),
                    "keep_warm": self.keep_warm.status(),
                    "wake_ups": self.recorders["tcp"].wake_ups.status(),
                    "startup": self.pair.startup, "spares": len(self.pair.spares),
                    "spares_ready": self.pair.spares_ready(),
                    "ranks": self.pair.status()}

        def set_fault(self, rank: int, kind: str | None, **params) -> str:
            import ray
            msg = ray.get(self.pair.ranks[rank].set_fault.remote(kind, **params))
            log.warning("fault injection: %s", msg)
            return msg

        def stamps(self) -> dict:
            """Recent per-step stamps of every party behind this endpoint (bench/step_latency.py)."""
            import ray
            return {**{party: r.stamps.recent() for party, r in self.recorders.items()},
                    "ranks": ray.get([a.stamps.remote() for a in self.pair.ranks], timeout=10)}

        def rank_pids(self) -> list[int]:
            return [s.get("pid") for s in self.pair.status()]

        def shutdown(self) -> None:
            try:
                self.directory.remove_worker(self.name)
            except ConnectionError as e:
                log.warning("front-end %s: its endpoint table entry stays: %s", self.name, e)
            self.server.stop()
            self.metrics.stop()
            self.pair.close()
            self.ring.unlink()
            log.info("front-end %s stopped", self.name)

    return FrontEnd
