"""The named points at which each party of the step path lets an observer look in. These are the null observers
(every hook does nothing, `idle` is None, a `seam...` installs nothing), so a party built without one runs its
algorithm alone; the actors hand in `recorders.py`'s, whose seams (`seams.py`) wrap the ring and the engine from
outside. Concurrent callers take a view of their own (`session`, `step`).
"""
from __future__ import annotations

from typing import Callable

Idle = Callable[[Callable[[], bool]], None]      # idle(ready): runs between a wait's polls, asks ready() between pieces


class ServerObserver:
    """A STEP server's connection thread: a frame read, a request answered (over TCP or a client's ring)."""

    idle: Idle | None = None

    def session(self, recv, reader) -> "ServerObserver":
        """The view of one connection, whose reads go through `recv` (wire.spinning_recv_into) into `reader`."""
        return self

    def read(self, received_ns: int) -> None:
        """A frame has been read and decoded (its header arrived at `received_ns`)."""

    def answered(self, msg: object, reply: object) -> None:
        """The reply to `msg` has been sent."""

    def ring_answered(self, msg: object, received_ns: int, reply: object) -> None:
        """The reply to `msg`, taken from the client's ring at `received_ns`, has been completed."""


class ServiceObserver:
    """The front-end's step service: a STEP's admission and its reply."""

    def step(self, received_ns: int) -> "ServiceObserver":
        """The view of one STEP, whose frame arrived at `received_ns`, as the service takes it."""
        return self

    def admitted(self) -> None:
        """The STEP's entries are checked and admitted."""

    def replied(self, seq: int | None) -> None:
        """The reply is built; its first entry ran in ring step `seq` (None: none ran)."""


class DriverObserver:
    """The front-end's ring driver: a batch published, its completions collected."""

    idle: Idle | None = None

    def seam(self, driver) -> None:
        """Look in on `driver` (a `RingDriver`) at its ring's seam from now on (seams.RingOut); once, when built."""

    def publishing(self) -> None:
        """A batch is handed to the ring: its encoding begins."""

    def posting(self) -> None:
        """The batch is encoded: its copy into the ring slot begins."""

    def published(self, seq: int) -> None:
        """The batch is in the ring as step `seq`."""

    def collected(self, batch, size: int, reply: bytes) -> None:
        """Every rank completed the batch (encoded in `size` bytes); rank 0 answered `reply`."""


class RankObserver:
    """A rank's step loop, its engine and its graph set."""

    idle: Idle | None = None

    def seam_ring(self, reader):
        """The rank's reader of the step ring as its loop uses it: `reader` itself, or a wrapper (seams.RingIn)."""
        return reader

    def seam_engine(self, engine) -> None:
        """Look in on `engine` (a `RankEngine`) at its step from now on (seams.observe_engine); once, when built."""

    def got(self, seq: int, sleeps: int) -> None:
        """Ring step `seq` has come; the ring's waits have slept `sleeps` times so far."""

    def stamp(self, name: str, cpu: bool = False) -> None:
        """The step has reached `name` (with `cpu`, also the thread's CPU time)."""

    def stamp_first(self, name: str, like: str | None = None) -> None:
        """`stamp(name)` unless the step has one by that name already; with `like`, the time of that stamp."""

    def answered(self, batch, results, size: int) -> None:
        """The answer is encoded (`results` None: the step failed); the batch still views the ring's slot."""

    def completed(self) -> None:
        """The step's completion is posted."""
