"""STEP over HTTP through Ray Serve: the convenience path, for tools and engines that speak JSON, not our frames.

A Serve deployment (FastAPI ingress) in front of a deployment's STEP endpoints (one per worker). Each HTTP session
is one `DrafterPool` of the replica's (its own TCP session with each worker's front-end), so each front-end batches
concurrent HTTP sessions as it batches TCP ones, a session's slots belong to it alone, and with several workers
(`serve --pairs N`) its slots are spread over them. An HTTP round trip through Serve costs
milliseconds (DESIGN.md measured ~10 ms for an echo): use the TCP or shared-memory client for the per-round path.

    POST   /v1/sessions                   {model_digest?, config_digest?, tp?, max_model_len?, client?}
                                          -> {session, limits, worker_generation, model_digest, ...}
    POST   /v1/sessions/{s}/acquire       {n}                    -> {slots: [{slot, generation}]}
    POST   /v1/sessions/{s}/release       {slots}                -> {released}
    POST   /v1/sessions/{s}/step          {entries, deadline_ms} -> {results}
    DELETE /v1/sessions/{s}                                      -> {closed}

An entry is the contract's Entry with its arrays in JSON: `token_ids` a list of ints, `taps` the fp16 rows as
base64 of their little-endian bytes (`taps_b64`). A body is as strict as a frame (docs/contract.md): the fields
the contract requires are required here (an entry's slot, generation, seed_token, start_pos and n_out; a STEP's
deadline_ms; ACQUIRE's n), the optional ones take the contract's defaults, an unknown field or a value of another
type (a float for an int, 1 for a bool) is refused, never guessed at. A result: `code` (the contract's code name),
`reason`, `generation`, `drafts`, `confidences` (the fp32 values as JSON numbers: exact), `margins` (or null),
`confident_len`. A refusal is HTTP 409 with {code, reason}; a malformed body 422 with {code: "BAD_REQUEST",
reason} naming the field; an unknown or expired session 404. A session unused for `session_ttl_s` is closed when
the next session opens (its slots are freed), as a TCP session is when its connection closes.
"""
from __future__ import annotations

import base64
import secrets
import threading
import time

import msgspec
import numpy as np

from ..client import ClientError
from ..contract import Code, make_entry
from ..pool import DrafterPool

ROUTE = "/dspark"
SESSION_TTL_S = 300.0


class _Json(msgspec.Struct, forbid_unknown_fields=True):
    """A request body, decoded as strictly as the contract's frames (msgspec.convert: no coercion)."""


class JsonEntry(_Json, kw_only=True):
    slot: int
    generation: int
    seed_token: int
    start_pos: int
    n_out: int
    token_ids: list[int] = []
    taps_b64: str = ""
    rollback_to: int = -1
    want_margins: bool = False


class JsonStep(_Json, kw_only=True):
    entries: list[JsonEntry]
    deadline_ms: float


class JsonAcquire(_Json, kw_only=True):
    n: int


class JsonRelease(_Json, kw_only=True):
    slots: list[int]


class JsonHello(_Json, kw_only=True):
    model_digest: str | None = None
    config_digest: str | None = None
    tp: int | None = None
    max_model_len: int | None = None
    client: str = "http"


class BadBody(ValueError):
    """A request body that breaks the contract's schema (HTTP 422)."""


def parse_body(body, kind: type, what: str):
    """`body` (parsed JSON) as `kind`, or BadBody naming the field and the rule."""
    try:
        return msgspec.convert(body, kind)
    except msgspec.ValidationError as e:
        raise BadBody(f"{what}: {e}") from None


def entry_from_json(e: dict | JsonEntry):
    """The contract's Entry from its JSON form (BadBody / ValueError on a malformed one). The taps' length against
    the rows is the contract's check (BAD_ENTRY for that entry, as over TCP)."""
    if not isinstance(e, JsonEntry):
        e = parse_body(e, JsonEntry, "entry")
    try:
        taps = np.frombuffer(base64.b64decode(e.taps_b64, validate=True), dtype="<f2")
    except ValueError as x:      # binascii.Error is a ValueError; an odd byte count too
        raise BadBody(f"entry: taps_b64: {x}") from None
    try:
        return make_entry(slot=e.slot, generation=e.generation, seed_token=e.seed_token, start_pos=e.start_pos,
                          token_ids=e.token_ids, taps=taps, rollback_to=e.rollback_to, n_out=e.n_out,
                          want_margins=e.want_margins)
    except ValueError as x:      # a token id beyond int32 (a cast would wrap it)
        raise BadBody(f"entry: token_ids: {x}") from None


def result_to_json(r) -> dict:
    margins = r.margins_array()
    return {"code": Code(r.code).name, "reason": r.reason, "generation": r.generation,
            "drafts": r.drafts_array().tolist(), "confidences": r.confidences_array().tolist(),
            "margins": margins.tolist() if margins.size else None, "confident_len": r.confident_len}


def entry_to_json(slot: int, generation: int, seed_token: int, token_ids, taps, start_pos: int = 0,
                  rollback_to: int = -1, n_out: int = 5, want_margins: bool = False) -> dict:
    """An entry in the JSON form this endpoint takes (for clients and tests)."""
    return {"slot": slot, "generation": generation, "seed_token": seed_token, "start_pos": start_pos,
            "token_ids": [int(t) for t in token_ids],
            "taps_b64": base64.b64encode(np.ascontiguousarray(taps, dtype="<f2").tobytes()).decode(),
            "rollback_to": rollback_to, "n_out": n_out, "want_margins": want_margins}


class _Sessions:
    """HTTP session token -> its DrafterPool (its slots over the deployment's workers); expired ones closed."""

    def __init__(self, endpoints: str, ttl_s: float):
        self.endpoints, self.ttl_s = endpoints, ttl_s
        self.lock = threading.Lock()
        self.clients: dict[str, tuple[DrafterPool, list[float]]] = {}

    def open(self, hello: JsonHello) -> tuple[str, object]:
        self.expire()
        c = DrafterPool(self.endpoints, timeout_s=30.0)
        try:
            reply = c.hello(model_digest=hello.model_digest, config_digest=hello.config_digest, tp=hello.tp,
                            max_model_len=hello.max_model_len, client=hello.client)
        except BaseException:
            c.close()
            raise
        token = secrets.token_hex(16)
        with self.lock:
            self.clients[token] = (c, [time.monotonic()])
        return token, reply

    def get(self, token: str) -> DrafterPool | None:
        with self.lock:
            got = self.clients.get(token)
        if got is None:
            return None
        got[1][0] = time.monotonic()
        return got[0]

    def close(self, token: str) -> bool:
        with self.lock:
            got = self.clients.pop(token, None)
        if got is not None:
            got[0].close()
        return got is not None

    def expire(self) -> None:
        now = time.monotonic()
        with self.lock:
            old = [t for t, (_, used) in self.clients.items() if now - used[0] > self.ttl_s]
        for t in old:
            self.close(t)


def build_app(endpoint: str, session_ttl_s: float = SESSION_TTL_S):
    """The Serve application for the STEP endpoint `endpoint` ("host:port", or the workers' endpoints
    comma-separated: each HTTP session's slots are then spread over them); run it with `serve.run(app,
    route_prefix=ROUTE)`."""
    from fastapi import Body, FastAPI, HTTPException
    from ray import serve

    api = FastAPI(title="dspark-ray STEP over HTTP")

    def refused(e: ClientError) -> HTTPException:
        return HTTPException(409, {"code": e.code.name if e.code is not None else "CONNECTION", "reason": str(e)})

    def bad(e: ValueError) -> HTTPException:
        return HTTPException(422, {"code": "BAD_REQUEST", "reason": str(e)})

    @serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
    @serve.ingress(api)
    class DrafterHttp:
        def __init__(self, endpoint: str, ttl_s: float):
            self.sessions = _Sessions(endpoint, ttl_s)

        def _client(self, s: str) -> DrafterPool:
            c = self.sessions.get(s)
            if c is None:
                raise HTTPException(404, {"code": "NO_SESSION", "reason": f"no session {s} (closed or expired)"})
            return c

        @api.post("/v1/sessions")
        def open_session(self, hello: dict = Body(default={})) -> dict:
            try:
                token, r = self.sessions.open(parse_body(hello, JsonHello, "hello"))
            except BadBody as e:
                raise bad(e) from None
            except ClientError as e:
                raise refused(e) from None
            return {"session": token, "limits": {f: getattr(r.limits, f) for f in r.limits.__struct_fields__},
                    "worker_generation": r.worker_generation, "model_digest": r.model_digest,
                    "config_digest": r.config_digest, "tp": r.tp, "max_model_len": r.max_model_len}

        @api.post("/v1/sessions/{s}/acquire")
        def acquire(self, s: str, body: dict = Body(...)) -> dict:
            c = self._client(s)
            try:
                grants = c.acquire(parse_body(body, JsonAcquire, "acquire").n)
            except BadBody as e:
                raise bad(e) from None
            except ClientError as e:
                raise refused(e) from None
            return {"slots": [{"slot": g.slot, "generation": g.generation} for g in grants]}

        @api.post("/v1/sessions/{s}/release")
        def release(self, s: str, body: dict = Body(...)) -> dict:
            c = self._client(s)
            try:
                return {"released": c.release(parse_body(body, JsonRelease, "release").slots)}
            except BadBody as e:
                raise bad(e) from None
            except ClientError as e:
                raise refused(e) from None

        @api.post("/v1/sessions/{s}/step")
        def step(self, s: str, body: dict = Body(...)) -> dict:
            c = self._client(s)
            try:
                msg = parse_body(body, JsonStep, "step")
                entries = [entry_from_json(e) for e in msg.entries]
            except BadBody as e:
                raise bad(e) from None
            try:
                return {"results": [result_to_json(r) for r in c.step(entries, deadline_ms=msg.deadline_ms)]}
            except ClientError as e:
                raise refused(e) from None

        @api.delete("/v1/sessions/{s}")
        def close_session(self, s: str) -> dict:
            return {"closed": self.sessions.close(s)}

    return DrafterHttp.bind(endpoint, session_ttl_s)


class ProxyElsewhere(RuntimeError):
    """Serve already runs its HTTP proxy in this Ray cluster on another address: it cannot move, and the app would
    not be where the user asked for it."""


def check_address(host: str, port: int) -> None:
    """Raise ProxyElsewhere if Serve runs in the connected Ray cluster with its proxy on another host:port (a
    running Serve keeps its first address: `serve.start` only warns and ignores a new one). Nothing if Serve is
    not running yet. Call it before deploying anything, so a refusal changes nothing."""
    from ray.serve.context import _get_global_client
    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:                      # no Serve controller in this cluster yet
        return
    have = client.http_config
    if (have.host, have.port) != (host, port):
        raise ProxyElsewhere(f"Ray Serve already runs its HTTP proxy on {have.host}:{have.port} in this cluster; "
                             f"ask for that address (--host {have.host} --http-port {have.port}) or stop Serve "
                             f"first (`serve shutdown`)")


def start(name: str, endpoint: str, host: str, port: int) -> str:
    """Run the app for the pair `name` (its STEP endpoint `endpoint`) on Ray Serve's HTTP proxy at host:port (Serve
    is started there if it is not running yet; ProxyElsewhere, and nothing deployed, if it runs on another
    address); returns the sessions URL."""
    from ray import serve
    check_address(host, port)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(endpoint), name=f"{name}-http", route_prefix=ROUTE)
    return f"http://{host}:{port}{ROUTE}/v1/sessions"


def stop(name: str) -> bool:
    """Delete the pair's HTTP app, if Serve runs one (Serve itself stays for other apps); whether there was one."""
    try:
        from ray import serve
        from ray.serve.context import _get_global_client
        if _get_global_client(raise_if_no_controller_running=False) is None:    # no Serve: nothing to start
            return False
        if f"{name}-http" in serve.status().applications:
            serve.delete(f"{name}-http")
            return True
    except Exception:           # no Serve in this cluster (or not installed): nothing to stop
        pass
    return False

