"""The observers the actors hand their parties: per-step stamps (stamps.py), wake-up counts (wake_ups.py) and
keep-warm rehearsals between steps (keep_warm.py; disabled, `idle` stays None and no samples are taken).
"""
from __future__ import annotations

from ..protocol.contract import Step, StepReply
from .keep_warm import KeepWarm, rehearse_frame, rehearse_rank_step, rehearse_ring_coding
from .observers import DriverObserver, RankObserver, ServerObserver, ServiceObserver
from .seams import RingIn, RingOut, observe_driver_run, observe_engine
from .stamps import Stamps, cpu_now, now
from .wake_ups import WakeUps


def _warm(keep_warm: KeepWarm | None) -> KeepWarm | None:
    return keep_warm if keep_warm is not None and keep_warm.enabled else None


class ServerRecorder(ServerObserver):
    """The STEP server's: stamps, wake-ups, and the frame's rehearsal (decode, `checks`, the reply's encoding)."""

    def __init__(self, party: str, spin_us: float, keep_warm: KeepWarm | None = None, checks=None):
        self.stamps = Stamps()
        self.wake_ups = WakeUps(party, spin_us)
        self.keep_warm = self.idle = _warm(keep_warm)
        self.checks = checks

    def session(self, recv, reader) -> "_ServerSession":
        return _ServerSession(self, recv, reader)

    def ring_answered(self, msg, received_ns: int, reply) -> None:
        if type(msg) is Step:
            self.stamps.add({"recv": received_ns, "read": received_ns, "sent": now(), "cpu_read": cpu_now()})


class _ServerSession(ServerObserver):
    """One connection's view (its thread's): the frame in hand."""

    def __init__(self, rec: ServerRecorder, recv, reader):
        self.rec, self.recv, self.reader = rec, recv, reader
        self.idle = rec.idle
        self.counts_sleeps = hasattr(recv, "slept")      # plain blocking reads (spin 0) are not counted
        self._read = (0, 0, 0)

    def read(self, received_ns: int) -> None:
        self._read = (received_ns, now(), cpu_now())

    def answered(self, msg, reply) -> None:
        if type(msg) is not Step:
            return
        rec, (received_ns, t_read, cpu_read) = self.rec, self._read
        rec.stamps.add({"recv": received_ns, "read": t_read, "sent": now(), "cpu_read": cpu_read})
        if self.counts_sleeps:
            rec.wake_ups.add(self.recv.slept)
        warm = rec.keep_warm
        if warm is not None:
            warm.ran()
            if type(reply) is StepReply and warm.wants_sample("frame", self.reader.last_length):
                rehearse_frame(warm, self.reader.last_payload(), reply, rec.checks)

    def ring_answered(self, msg, received_ns: int, reply) -> None:
        self.rec.ring_answered(msg, received_ns, reply)


class ServiceRecorder(ServiceObserver):
    """The step service's: taken, admitted, answered, and the ring step (the join key with the ranks' stamps)."""

    def __init__(self):
        self.stamps = Stamps()

    def step(self, received_ns: int) -> "_ServiceStep":
        return _ServiceStep(self.stamps, received_ns)


class _ServiceStep(ServiceObserver):
    __slots__ = ("stamps", "row")

    def __init__(self, stamps: Stamps, received_ns: int):
        self.stamps, self.row = stamps, {"recv": received_ns, "in": now()}

    def admitted(self) -> None:
        self.row["admitted"], self.row["cpu_admitted"] = now(), cpu_now()

    def replied(self, seq: int | None) -> None:
        row = self.row
        row["reply"], row["cpu_reply"], row["seq"] = now(), cpu_now(), seq
        self.stamps.add(row)


class DriverRecorder(DriverObserver):
    """The ring driver's: per batch the times it was handed over, posted and completed, with its ring step; its
    wait for the completions rehearses the batch's encoding and the reply's decoding."""

    def __init__(self, keep_warm: KeepWarm | None = None):
        self.stamps = Stamps()
        self.keep_warm = self.idle = _warm(keep_warm)
        self.row: dict = {}

    def seam(self, driver) -> None:
        driver.ring = out = RingOut(driver.ring, self)
        observe_driver_run(driver, self, out)

    def publishing(self) -> None:
        self.row = {"publish": now()}

    def posting(self) -> None:
        self.row["posting"] = now()

    def published(self, seq: int) -> None:
        self.row["seq"] = seq

    def collected(self, batch, size: int, reply: bytes) -> None:
        row = self.row
        row["completions"], row["cpu_completions"] = now(), cpu_now()
        self.stamps.add(row)
        warm = self.keep_warm
        if warm is not None and warm.wants_sample("batch", size):
            rehearse_ring_coding(warm, batch, reply)


class StepMarks(RankObserver):
    """The stamps of the step in hand, in `row`: what a bench reads of one call of a graph set or an engine (it
    empties `row` before each)."""

    def __init__(self):
        self.row: dict = {}

    def stamp(self, name: str, cpu: bool = False) -> None:
        self.row[name] = now()
        if cpu:
            self.row["cpu_" + name] = cpu_now()

    def stamp_first(self, name: str, like: str | None = None) -> None:
        if name not in self.row:
            self.row[name] = self.row[like] if like is not None else now()


class RankRecorder(StepMarks):
    """A rank's: per step its ring seq and the times of its loop's, engine's and graph set's named points; whether
    the wait for it slept; between steps (the ring's wait, the GPU's) the last step's rehearsal."""

    def __init__(self, rank: int, spin_us: float, keep_warm: KeepWarm | None = None):
        super().__init__()
        self.rank = rank
        self.stamps = Stamps()
        self.wake_ups = WakeUps(f"rank {rank}", spin_us)
        self.keep_warm = keep_warm
        self.idle = _warm(keep_warm)
        self._engine = None
        self._sleeps, self._woke = 0, False
        self.batch = self.results = None        # the step in hand's, as the engine's seam saw them

    def seam_ring(self, reader) -> RingIn:
        return RingIn(reader, self)

    def seam_engine(self, engine) -> None:
        self.serving(engine)
        observe_engine(engine, self)

    def serving(self, engine) -> None:
        self._engine = engine

    def got(self, seq: int, sleeps: int) -> None:
        self.row = {"seq": seq, "got": now(), "cpu_got": cpu_now()}
        self._woke, self._sleeps = sleeps != self._sleeps, sleeps
        self.batch = self.results = None

    def answered(self, batch, results, size: int) -> None:
        # stamped before the hand-off: the front-end may see the completion at once
        self.row["encoded"], self.row["cpu_encoded"] = now(), cpu_now()
        warm = self.idle
        if warm is not None and results is not None and warm.wants_sample("batch", size):
            rehearse_rank_step(warm, self._engine, batch, results if self.rank == 0 else None)

    def completed(self) -> None:
        self.batch = self.results = None        # the batch viewed the ring's slot, the ring's again now
        if self.idle is not None:
            self.idle.ran()
        self.stamps.add(self.row)
        self.wake_ups.add(self._woke)

    def status(self) -> dict:
        return {"keep_warm": self.keep_warm.status() if self.keep_warm is not None else None,
                "wake_ups": self.wake_ups.status()}
