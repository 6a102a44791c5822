"""`PairLauncher`: the Ray side of one pair. It creates the rank actors in their placement-group bundles, loads,
connects and serves them on the step ring, and on a restart kills them and does it again. Per step it does nothing:
that is `ring_driver.RingDriver`.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import asdict

from ..settings import current as settings
from ..spec import SAFE_ENV, PairSpec
from ..transport.ring import StepRing

log = logging.getLogger("dspark_ray.pair")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PairLauncher:
    """The rank actors of one pair, serving `ring`."""

    def __init__(self, spec: PairSpec, ring: StepRing, pg=None, rank_bundles: list[int] | None = None,
                 rank_resources=None, name: str = "dspark"):
        self.spec, self.ring, self.pg, self.name = spec, ring, pg, name
        self.rank_bundles = rank_bundles or list(range(spec.tp))
        self.rank_resources = rank_resources or {"num_cpus": 0.5}
        self.ranks: list = []
        self.placement: list[dict] = []    # per rank: its node and cards (RankActor.placement)
        self.progress_cb = None
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

    def restart(self, first: list[tuple[int, int, bool]] | None = None) -> None:
        # The checkpoint's files back into the page cache now, while the new ranks' processes start (if the host
        # dropped them): their weights are read from memory (weights/staging.py).
        from ..weights.staging import prefetch
        threading.Thread(target=prefetch, args=(self.checkpoint_files,), name="dspark-prefetch", daemon=True).start()
        self.kill()
        self.start(first)

    def status(self) -> list[dict]:
        import ray
        out = []
        for r, a in enumerate(self.ranks):
            try:
                out.append(ray.get(a.status.remote(), timeout=2))
            except Exception as e:
                out.append({"rank": r, "error": f"{type(e).__name__}: {e}"})
        return out
