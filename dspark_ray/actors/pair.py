"""`PairLauncher`: starts one pair's rank actors in their bundles, serves them on the step ring, and on a restart
kills them and starts them again (from spares where there are). The step path is `ring_driver.RingDriver`'s."""
from __future__ import annotations

import logging
import re
import socket
import threading
import time
from dataclasses import asdict, dataclass

from ..settings import current as settings
from ..spec import SAFE_ENV, PairSpec
from ..transport.ring import StepRing

log = logging.getLogger("dspark_ray.pair")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PairLauncher:
    def __init__(self, spec: PairSpec, ring: StepRing, pg=None, rank_bundles: list[int] | None = None,
                 rank_resources=None, name: str = "dspark"):
        self.spec, self.ring, self.pg, self.name = spec, ring, pg, name
        self.rank_bundles = rank_bundles or list(range(spec.tp))
        self.rank_resources = rank_resources or {"num_cpus": 0.5}
        self.ranks: list = []
        self.placement: list[dict] = []    # per rank: its node and cards
        self.progress_cb = None
        self.startup: dict[str, float] = {}         # the last start-up's wall-clock stamps (bench/restart.py)
        self.checkpoint_files: list[str] = []       # read ahead on a restart
        self.spares: list[_Spares] = []    # oldest first
        self._spare_seq = 0
        self._lock = threading.Lock()

    def _actor_options(self, r: int, name: str) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        share = 1 + self.spec.spares
        opts = {k: v / share for k, v in self.rank_resources.items()}
        # The front-end's settings, whatever the node's environment says.
        env = {**SAFE_ENV, **settings().as_env(), "OMP_NUM_THREADS": str(self.spec.torch_threads),
               "PYTHONUNBUFFERED": "1"}
        if self.spec.device.startswith("cuda"):
            # EAGER only where push collectives spin: a lazy load can stall against them (docs/collectives.md).
            # Set either way, never inherited from the node.
            env["CUDA_MODULE_LOADING"] = "EAGER" if self.spec.backend == "push" else "LAZY"
        opts["runtime_env"] = {"env_vars": env}
        opts["max_restarts"] = 0         # the front-end restarts the pair as a whole, never one rank alone
        opts["name"], opts["namespace"] = name, "dspark"     # a restarted front-end finds leftovers by name
        if self.pg is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=self.rank_bundles[r])
        return opts

    def rank_name(self, r: int) -> str:
        return f"{self.name}-rank{r}"

    def _new_ranks(self, suffix: str = "") -> list:
        from .rank import rank_actor_class           # torch: kept out of the front-end's imports
        Rank = rank_actor_class()
        return [Rank.options(**self._actor_options(r, self.rank_name(r) + suffix)).remote(asdict(self.spec), r)
                for r in range(self.spec.tp)]

    def kill_leftovers(self, timeout_s: float = 30.0) -> None:
        """Kill this pair's rank actors that outlived a dead front-end, and wait until their names are free."""
        import ray
        from ray.util import list_named_actors
        own = re.compile(rf"{re.escape(self.name)}-rank\d+(\.spare\d+)?")
        deadline = time.monotonic() + timeout_s
        while True:
            left = [a["name"] for a in list_named_actors(all_namespaces=True)
                    if a["namespace"] == "dspark" and own.fullmatch(a["name"])]
            if not left:
                return
            for n in left:
                try:
                    ray.kill(ray.get_actor(n, namespace="dspark"), no_restart=True)
                except ValueError:       # gone meanwhile
                    pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank actors {left} still exist after {timeout_s} s")
            time.sleep(0.1)

    def start(self, first: list[tuple[int, int, bool]] | None = None, spares: "_Spares | None" = None) -> None:
        """Load, connect and serve `spares` or new ranks. `first`: the last batches' shapes, captured first."""
        import ray
        stamp = self.startup = {"begun": time.time(), "from_spares": spares is not None}
        if spares is None:
            self.kill_leftovers()
            with self._lock:
                self.spares = []
        stamp["old_ranks_gone"] = time.time()
        t0 = time.monotonic()
        self.ranks = spares.ranks if spares is not None else self._new_ranks()
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
        # Not during the start-up, which they would slow down.
        self._refill_spares()
        log.info("pair %s: %d ranks up in %.2f s (%s%s)", self.name, self.spec.tp, time.monotonic() - t0,
                 self.spec.backend if self.spec.tp == 2 else "tp1", ", from spares" if spares is not None else "")

    def _refill_spares(self) -> None:
        """Start spare ranks up to the spec's count; each prepares (RankWorker.prepare), then waits."""
        with self._lock:
            while len(self.spares) < self.spec.spares:
                self._spare_seq += 1
                ranks = self._new_ranks(f".spare{self._spare_seq}")
                self.spares.append(_Spares(ranks, [a.prepare.remote(pin_files=True) for a in ranks]))

    def spares_ready(self) -> int:
        """Sets of spare ranks prepared; a set with a dead process is made again."""
        import ray
        with self._lock:
            spares = list(self.spares)
        ready, dead = 0, []
        for s in spares:
            done, _ = ray.wait(s.prepared, num_returns=len(s.prepared), timeout=0)
            try:
                ray.get(done, timeout=0)
            except Exception as e:
                log.warning("pair %s: a spare rank died before use (%s): making another", self.name,
                            type(e).__name__)
                dead.append(s)
                continue
            ready += len(done) == len(s.prepared)
        if dead:
            with self._lock:
                self.spares = [s for s in self.spares if s not in dead]
            for s in dead:
                _kill(s.ranks)
            self._refill_spares()
        return ready

    def kill(self) -> None:
        _kill(self.ranks)
        self.ranks = []

    def restart(self, first: list[tuple[int, int, bool]] | None = None) -> None:
        # Back into the page cache while the new ranks start, in case the host dropped them.
        from ..weights.staging import prefetch
        threading.Thread(target=prefetch, args=(self.checkpoint_files,), name="dspark-prefetch", daemon=True).start()
        self.kill()
        while True:
            with self._lock:
                spares = self.spares.pop(0) if self.spares else None
            if spares is None:
                return self.start(first)
            try:
                return self.start(first, spares)
            except Exception as e:      # a spare died (or was killed while promoted): the next, else new ranks
                log.warning("pair %s: spare ranks failed to start (%s: %s): trying %s", self.name,
                            type(e).__name__, e, "the next spares" if self.spares else "new ranks")
                self.kill()

    def close(self) -> None:
        self.kill()
        with self._lock:
            spares, self.spares = self.spares, []
        for s in spares:
            _kill(s.ranks)

    def status(self) -> list[dict]:
        import ray
        out = []
        for r, a in enumerate(self.ranks):
            try:
                out.append(ray.get(a.status.remote(), timeout=2))
            except Exception as e:
                out.append({"rank": r, "error": f"{type(e).__name__}: {e}"})
        return out


@dataclass(eq=False)        # compared by identity
class _Spares:
    ranks: list            # one actor per rank
    prepared: list


def _kill(actors: list) -> None:
    import ray
    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:       # already dead
            pass
