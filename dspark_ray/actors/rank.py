"""`RankActor`: the Ray actor of one rank, a thin shell around `rank/worker.py`'s `RankWorker`."""
from __future__ import annotations

import logging

from ..observe.keep_warm import KeepWarm
from ..rank.worker import RankWorker
from ..observe.recorders import RankRecorder
from ..spec import PairSpec


def rank_actor_class():
    """The Ray actor class (built lazily so importing this module needs no Ray)."""
    import ray

    @ray.remote(max_concurrency=4)          # status / faults answer while the dispatch thread runs
    class RankActor:
        def __init__(self, spec: dict, rank: int):
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
            spec = spec if isinstance(spec, PairSpec) else PairSpec(**spec)
            self.recorder = RankRecorder(rank, spec.spin_us, KeepWarm(f"rank {rank}"))
            self.w = RankWorker(spec, rank, observer=self.recorder)

        def prepare(self, pin_files=False):
            return self.w.prepare(pin_files)

        def load(self):
            return self.w.load()

        def progress(self):
            return self.w.progress()

        def connect(self, init_method, first=None):
            return self.w.connect(init_method, first)

        def serve(self, ring_handle):
            return self.w.serve(ring_handle)

        def status(self):
            return {**self.w.status(), **self.recorder.status(), **self.placement()}

        def placement(self) -> dict:
            """Where Ray put this rank: its node and GPU ids."""
            ctx = ray.get_runtime_context()
            return {"node_id": ctx.get_node_id(), "cards": ctx.get_accelerator_ids().get("GPU", [])}

        def stamps(self):
            return self.recorder.stamps.recent()

        def set_fault(self, kind: str | None, **params):
            from ..rank.faults import install
            return install(self.w, kind, **params)

        def stop(self):
            return self.w.stop()

    return RankActor


