"""`DrafterPool`: one engine's slots spread over a deployment's workers, each STEP sent to every worker it names
before any answer is read; a down worker's entries answer UNAVAILABLE while the others serve (docs/operations.md,
"Scaling over card pairs"; `from_deployment`: docs/contract.md, section 11). Needs what client.py needs.

    with DrafterPool(["10.0.0.5:7001", "10.0.0.5:7002"]) as pool:
        pool.hello(config_digest=..., tp=2)
        grants = pool.acquire(8)                   # spread over the workers
        results = pool.step([make_entry(slot=g.slot, generation=g.generation, ...) for g in grants])
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Sequence

import msgspec

from .drafter_client import ClientError, DrafterClient
from ..protocol.contract import Code, Entry, EntryResult, HelloReply, Limits, SlotGrant, error_result

__all__ = ["DrafterPool"]

log = logging.getLogger("dspark_ray.pool")


@dataclass
class PoolPendingStep:
    """A STEP sent by `DrafterPool.step_begin`, its answers not all read yet."""
    entries: list[Entry]
    results: list[EntryResult | None]                # filled in as the answers are read (some at once: refused)
    sent: list = field(default_factory=list)         # (worker index, entry indices, the client's PendingStep)


@dataclass
class _Worker:
    endpoint: str | None                             # None: not serving anywhere now (from_deployment only)
    name: str | None = None
    client: DrafterClient | None = None
    hello: HelloReply | None = None
    held: set[int] = field(default_factory=set)     # the worker's own slot ids this pool holds
    down: str | None = "not connected yet"           # why it is not used now; None while it serves
    lost: str = ""
    session: int = -1                                # how many sessions it had before the current one
    reviver: threading.Thread | None = None

    @property
    def label(self) -> str:
        return f"{self.name} ({self.endpoint or 'not serving'})" if self.name else str(self.endpoint)


class DrafterPool:
    def __init__(self, endpoints: Sequence[str] | str, *, timeout_s: float = 5.0, spin_us: float = 0.0,
                 shm: bool = False, retry_s: float = 1.0, token: str | None = None):
        """`endpoints`: the workers' "host:port" (a list, or one string with commas). `timeout_s`, `spin_us`,
        `shm`, `token`: as for each worker's DrafterClient. `retry_s`: how often a down worker is tried again."""
        if isinstance(endpoints, str):
            endpoints = [e for e in endpoints.split(",") if e.strip()]
        if not endpoints:
            raise ValueError("a pool needs at least one endpoint")
        self.workers = [_Worker(e.strip()) for e in endpoints]
        self.timeout_s, self.spin_us, self.shm, self.retry_s = timeout_s, spin_us, shm, retry_s
        self._token = token
        self._resolve = None
        self.stride = 0
        self.hello_reply: HelloReply | None = None
        self._identity: dict = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._pending: PoolPendingStep | None = None

    @classmethod
    def from_deployment(cls, address: str | None = None, name: str = "dspark", *, resolve_timeout_s: float = 2.0,
                        token: str | None = None, **kw) -> "DrafterPool":
        """A pool over the deployment `name`, its workers found through the GCS at `address` ("HEAD:6379"; None:
        RAY_ADDRESS or the one cluster on this host), each read bounded by `resolve_timeout_s`; `token`: the
        deployment's, read from the cluster where None (only holders of Ray's token may read it, where the cluster
        has token authentication). `kw`: the constructor's. LookupError: no such deployment; ConnectionError: the
        GCS does not answer, or refuses this process (Ray's token)."""
        from .endpoints import Directory
        directory = Directory(address, timeout_s=resolve_timeout_s)
        found = directory.endpoints(name)
        if token is None:
            token = directory.token(name)
        pool = cls(["-"] * len(found), token=token, **kw)
        for w, (worker, ep) in zip(pool.workers, found.items()):
            w.name, w.endpoint = worker, ep
        pool._resolve = lambda: directory.endpoints(name)
        return pool

    @property
    def limits(self) -> Limits:
        """The first worker's limits (every worker's, but for slot_capacity)."""
        self._need_hello()
        return self.hello_reply.limits

    def hello(self, *, model_digest: str | None = None, config_digest: str | None = None, tp: int | None = None,
              max_model_len: int | None = None, client: str = "dspark-ray-pool") -> HelloReply:
        """Open a session on every worker; returns the first worker's reply. An unreachable worker is marked down
        (retried in the background); one that refuses, or serves another model than the first, raises ClientError."""
        with self._lock:
            if self.hello_reply is not None or self._closed.is_set():
                raise ClientError("one hello per pool")
            self._identity = dict(model_digest=model_digest, config_digest=config_digest, tp=tp,
                                  max_model_len=max_model_len, client=client)
            opened = []
            try:
                for w in self.workers:
                    opened.append(self._open(w))
                    if opened[-1][0] is not None and self.hello_reply is None:
                        self.hello_reply = opened[-1][1]      # the identity every other worker must serve
                for w, (c, got) in zip(self.workers, opened):
                    if c is not None:
                        self._check_same_model(w, c, got)
            except ClientError:
                for c, _ in opened:
                    if c is not None:
                        c.close()
                self.hello_reply = None
                raise
            if self.hello_reply is None:
                raise ClientError("no worker reachable: " + "; ".join(str(why) for _, why in opened))
            self.stride = max(got.limits.slot_capacity for c, got in opened if c is not None)
            for w, (c, got) in zip(self.workers, opened):
                if c is not None:
                    self._install(w, c, got)
                else:
                    self._mark_down(w, got)
            return self.hello_reply

    def _open(self, w: _Worker) -> tuple[DrafterClient | None, object]:
        """(client, HELLO reply), or (None, why) when `w` cannot be reached; a refusal raises. Takes no lock."""
        if w.endpoint is None:
            return None, f"worker {w.name} does not serve now (waiting for room, starting, or its node lost)"
        try:
            c = DrafterClient(*_split(w.endpoint), timeout_s=self.timeout_s, spin_us=self.spin_us, shm=self.shm,
                              token=self._token)
        except ClientError as e:
            return None, str(e)
        try:
            return c, c.hello(**self._identity)
        except ClientError as e:
            c.close()
            if e.code is None:              # lost on the way: try again later
                return None, str(e)
            raise

    def _check_same_model(self, w: _Worker, c: DrafterClient, reply: HelloReply) -> None:
        first = self.hello_reply
        if (reply.model_digest, reply.config_digest) != (first.model_digest, first.config_digest):
            raise ClientError(f"worker {w.label} serves model {reply.model_digest} / config "
                              f"{reply.config_digest}, the pool's first worker {first.model_digest} / "
                              f"{first.config_digest}", Code.CONFIG_MISMATCH)

    def _install(self, w: _Worker, c: DrafterClient, reply: HelloReply) -> None:
        w.client, w.hello, w.down, w.session = c, reply, None, w.session + 1
        if w.session > 0:
            log.info("pool: worker %s back (worker generation %d)", w.label, reply.worker_generation)

    def _mark_down(self, w: _Worker, why: str) -> None:
        """`w`'s slots are gone; a thread tries it again every `retry_s` (caller holds the lock)."""
        if w.down is None:
            log.warning("pool: worker %s down: %s", w.label, why)
        if w.client is not None:
            w.client.close()
        w.client, w.held, w.down, w.lost = None, set(), why, why
        if w.reviver is None or not w.reviver.is_alive():
            w.reviver = threading.Thread(target=self._revive, args=(w,), name=f"pool-revive:{w.label}",
                                         daemon=True)
            w.reviver.start()

    def _revive(self, w: _Worker) -> None:
        while not self._closed.wait(self.retry_s):
            self._follow(w)
            try:
                c, got = self._open(w)
            except ClientError as e:            # it refuses us now: stays down, with the reason
                c, got = None, f"refused: {e}"
            with self._lock:
                if self._closed.is_set() or w.down is None:
                    if c is not None:
                        c.close()
                    return
                if c is None:
                    w.down = got
                    continue
                if got.limits.slot_capacity > self.stride:
                    c.close()
                    w.down = f"its {got.limits.slot_capacity} slots exceed the pool's stride {self.stride}"
                    continue
                try:
                    self._check_same_model(w, c, got)
                except ClientError as e:
                    c.close()
                    w.down = str(e)
                    continue
                self._install(w, c, got)
                return

    def _follow(self, w: _Worker) -> None:
        """Read a down worker's endpoint again (from_deployment only); a table that does not answer leaves it."""
        if self._resolve is None:
            return
        try:
            ep = self._resolve().get(w.name)
        except (ConnectionError, LookupError) as e:
            log.warning("pool: worker %s: endpoint table not read: %s", w.name, e)
            return
        if ep != w.endpoint:
            log.info("pool: worker %s %s", w.name, f"serves at {ep} now (was {w.endpoint})" if ep
                     else f"no longer at {w.endpoint}: waiting for it to serve again")
            w.endpoint = ep

    def close(self) -> None:
        with self._lock:
            self._closed.set()
            self._pending = None
            for w in self.workers:
                if w.client is not None:
                    w.client.close()
                w.client, w.held, w.down = None, set(), "closed"

    def __enter__(self) -> "DrafterPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def status(self) -> list[dict]:
        """Per worker: its name (from_deployment), endpoint, slots held, and why it is down (None while it serves)."""
        with self._lock:
            return [{"name": w.name, "endpoint": w.endpoint, "held": len(w.held), "down": w.down}
                    for w in self.workers]

    def acquire(self, n: int = 1) -> list[SlotGrant]:
        """n fresh slots, each to the serving worker with the most free. All or nothing: ClientError(OVERLOADED)
        when the workers cannot grant n together now, ClientError(BAD_ENTRY) when they never could."""
        if n < 1:
            raise ClientError(f"acquire: n {n} < 1 (ask for at least one slot)", Code.BAD_ENTRY)
        with self._lock:
            self._need_hello()
            self._need_idle()
            most = self.stride * len(self.workers)
            if n > most:         # a worker's own words (contract.validate_acquire), for the pool's workers together
                over = f"slot_capacity {self.stride}" + (f" x {len(self.workers)} workers" if len(self.workers) > 1
                                                         else "")
                raise ClientError(f"acquire: n {n} > {over}: can never be granted", Code.BAD_ENTRY)
            free = {i: w.hello.limits.slot_capacity - len(w.held) for i, w in enumerate(self.workers)
                    if w.down is None}
            grants: list[SlotGrant] = []
            try:
                while len(grants) < n:
                    want = _plan(free, n - len(grants))
                    if want is None:
                        raise ClientError(f"asked for {n} slots, the pool's serving workers could grant "
                                          f"{len(grants) + sum(free.values())}", Code.OVERLOADED)
                    for i, k in want.items():
                        w = self.workers[i]
                        try:
                            got = self._on(w, lambda c: c.acquire(k))
                        except ClientError as e:
                            if e.code not in (None, Code.OVERLOADED):
                                raise
                            del free[i]             # full, or gone: its share goes to the others
                            continue
                        w.held.update(g.slot for g in got)
                        free[i] -= len(got)
                        grants += [SlotGrant(slot=self._pool_slot(i, g.slot), generation=g.generation) for g in got]
            except ClientError:
                self._release_locked([g.slot for g in grants])
                raise
            return grants

    def release(self, slots: Sequence[int]) -> list[int]:
        """Give pool slots back; returns those released (a slot lost with its worker is only forgotten)."""
        with self._lock:
            self._need_idle()
            return self._release_locked(slots)

    def _release_locked(self, slots: Sequence[int]) -> list[int]:
        done = []
        by_worker: dict[int, list[int]] = {}
        for s in slots:
            i, own, why = self._locate(int(s))
            if why is None:
                by_worker.setdefault(i, []).append(own)
        for i, own in by_worker.items():
            w = self.workers[i]
            try:
                freed = self._on(w, lambda c: c.release(own))
            except ClientError:
                continue
            w.held.difference_update(freed)
            done += [self._pool_slot(i, s) for s in freed]
        return done

    def step(self, entries: Sequence[Entry], deadline_ms: float = 100.0) -> list[EntryResult]:
        """One result per entry, in order. An entry whose slot the pool does not hold answers BAD_ENTRY, one lost
        with its worker UNAVAILABLE; the rest still run."""
        return self.step_end(self.step_begin(entries, deadline_ms))

    def step_begin(self, entries: Sequence[Entry], deadline_ms: float = 100.0) -> "PoolPendingStep":
        """Send the STEP to every worker it names without waiting for an answer; `step_end` reads them. Until then
        the pool takes no other request (RuntimeError)."""
        with self._lock:
            self._need_hello()
            self._need_idle()
            results: list[EntryResult | None] = [None] * len(entries)
            groups: dict[int, list[int]] = {}
            owns: list[int] = [0] * len(entries)
            for k, e in enumerate(entries):
                i, owns[k], why = self._locate(e.slot)
                if why is None:
                    groups.setdefault(i, []).append(k)
                else:
                    results[k] = error_result(*why, e.generation)
            pending = PoolPendingStep(list(entries), results)
            for i, ks in groups.items():
                w = self.workers[i]
                mine = [msgspec.structs.replace(entries[k], slot=owns[k]) for k in ks]
                try:
                    pending.sent.append((i, ks, w.client.step_begin(mine, deadline_ms)))
                except ClientError as e:
                    self._fail(i, ks, entries, results, e)
            self._pending = pending if pending.sent else None
            return pending

    def step_end(self, pending: "PoolPendingStep") -> list[EntryResult]:
        """The answers to a `step_begin`'s STEP, in its entries' order."""
        with self._lock:
            if pending.sent and self._pending is not pending:
                raise RuntimeError("step_end: that STEP was already read")
            self._pending = None
            for i, ks, sent in pending.sent:
                try:
                    got = self.workers[i].client.step_end(sent)
                except ClientError as e:
                    self._fail(i, ks, pending.entries, pending.results, e)
                    continue
                for k, r in zip(ks, got):
                    pending.results[k] = r
            pending.sent = []
            return pending.results        # type: ignore[return-value]

    @property
    def pending(self) -> "PoolPendingStep | None":
        """The STEP sent by `step_begin` whose answers are not read yet."""
        return self._pending

    def _fail(self, i: int, ks: list[int], entries, results, e: ClientError) -> None:
        """Worker i's entries answer its refusal of the STEP, or UNAVAILABLE when its connection is gone."""
        w = self.workers[i]
        if e.code is None:
            self._mark_down(w, str(e))
            code = Code.UNAVAILABLE
        else:
            code = e.code
        for k in ks:
            results[k] = error_result(code, str(e), entries[k].generation)

    def _need_hello(self) -> None:
        if self.hello_reply is None:
            raise ClientError("HELLO first: call hello()")

    def _need_idle(self) -> None:
        """A worker's connection carries one request at a time: a pending STEP is read before the next request."""
        if self._pending is not None:
            raise RuntimeError("a STEP sent by step_begin is not read yet: call step_end first")

    def worker_of(self, slot: int) -> str | None:
        """The endpoint of the worker that holds pool slot `slot` now, or None."""
        i, _, why = self._locate(int(slot))
        return None if why else self.workers[i].endpoint

    # The session in a pool slot id: a slot lost with a worker's session is never taken for one granted after it.
    def _pool_slot(self, i: int, own: int) -> int:
        return (self.workers[i].session * len(self.workers) + i) * self.stride + own

    def _locate(self, slot: int) -> tuple[int, int, tuple[Code, str] | None]:
        """(worker index, its own slot id, None) of a pool slot this pool holds; else (-1, -1, (code, reason)):
        UNAVAILABLE for a slot lost with its worker's session, BAD_ENTRY for one the pool never granted."""
        q, own = divmod(slot, self.stride) if self.stride > 0 and slot >= 0 else (-1, -1)
        session, i = divmod(q, len(self.workers)) if q >= 0 else (-1, -1)
        w = self.workers[i] if i >= 0 else None
        if w is not None and (session < w.session or (session == w.session and w.down is not None)):
            return -1, -1, (Code.UNAVAILABLE, f"slot {slot}: lost with worker {w.label} ({w.lost}): acquire "
                                              f"a new slot and insert its context there")
        if w is None or session != w.session or own not in w.held:
            return -1, -1, (Code.BAD_ENTRY, f"slot {slot}: not held by this pool")
        return i, own, None

    def _on(self, w: _Worker, call):
        """Run a request on a serving worker; a lost connection marks it down (ClientError raised either way)."""
        if w.client is None:
            raise ClientError(f"worker {w.label} is down: {w.down}")
        try:
            return call(w.client)
        except ClientError as e:
            if e.code is None:
                self._mark_down(w, str(e))
            raise


def _plan(free: dict[int, int], n: int) -> dict[int, int] | None:
    """{worker: slots} for n slots, each to the worker with the most free left (ties: the lower index), or None."""
    if sum(max(0, f) for f in free.values()) < n:
        return None
    want = dict.fromkeys(free, 0)
    for _ in range(n):
        want[max(free, key=lambda i: (free[i] - want[i], -i))] += 1
    return {i: k for i, k in want.items() if k}


def _split(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.rsplit(":", 1)
    return host, int(port)
