"""STEP over HTTP through Ray Serve: the convenience path, for tools and engines that speak JSON, not our frames.

A Serve deployment (FastAPI ingress) in front of a deployment's STEP endpoints (one per worker). Each HTTP session
is one `DrafterPool` of the replica's (its own TCP session with each worker's front-end), so each front-end batches
concurrent HTTP sessions as it batches TCP ones, a session's slots belong to it alone, and with several workers
(`serve --pairs N`) its slots are spread over them. An HTTP round trip through Serve costs
milliseconds (~10 ms for an echo): use the TCP or shared-memory client for the per-round path.

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
`confident_len`. A session unused for `session_ttl_s` is closed when the next session opens (its slots are freed),
as a TCP session is when its connection closes.

Every refusal is a JSON object {code, reason}:

    409  the contract's refusal of a whole request (its code: BAD_ENTRY, OVERLOADED, CONFIG_MISMATCH, ...) with
         the reason TCP gives for the same request (a STEP's deadline, its entry count: `contract.validate_step`)
    422  BAD_REQUEST: the body is not JSON, or breaks the schema (the reason names the field)
    404  NO_SESSION (an unknown or expired session), NOT_FOUND (no such route); 405 METHOD_NOT_ALLOWED
    413  TOO_LARGE: a body over `max_body_bytes` (the TCP frame limit), answered from its Content-Length before a
         byte of it is read (a body sent without one is refused once it grows past the limit)
    408  BODY_TIMEOUT: a body that stops arriving for `body_stall_s` (TCP's stall timeout) is refused, its
         connection freed
"""
from __future__ import annotations

import asyncio
import base64
import json
import secrets
import threading
import time

import msgspec
import numpy as np

from .client import ClientError
from .contract import Code, Step, make_entry, validate_step
from .pool import DrafterPool
from .wire import DEFAULT_MAX_FRAME_BYTES

ROUTE = "/dspark"
SESSION_TTL_S = 300.0
BODY_STALL_S = 5.0            # as TcpServer's stall_timeout_s: no progress for this long mid-request is a stall


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


class BodyLimits:
    """ASGI middleware: a request's body is read here, whole, before the app sees it, within two bounds. Over
    `max_bytes` is 413 TOO_LARGE: at once when the Content-Length says so (nothing of the body is read), else as
    soon as the bytes received pass it. No progress for `stall_s` is 408 BODY_TIMEOUT. (Serve's proxy passes the
    body on in the pieces it gets; FastAPI would otherwise read, and parse, whatever came.)"""

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_FRAME_BYTES, stall_s: float = BODY_STALL_S):
        self.app, self.max_bytes, self.stall_s = app, max_bytes, stall_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        try:
            length = int(length) if length is not None else None
        except ValueError:
            return await refuse(send, 400, "BAD_REQUEST", f"Content-Length {length!r} is not a number")
        if length is not None and length > self.max_bytes:
            return await refuse(send, 413, "TOO_LARGE", self._too_large(length))
        body, more = bytearray(), True
        while more:
            try:
                msg = await asyncio.wait_for(receive(), self.stall_s)
            except asyncio.TimeoutError:
                return await refuse(send, 408, "BODY_TIMEOUT", f"the request body stalled: {len(body)} of "
                                    f"{length if length is not None else '?'} bytes, then none for "
                                    f"{self.stall_s:g} s")
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > self.max_bytes:
                return await refuse(send, 413, "TOO_LARGE", self._too_large(None))
        whole = {"type": "http.request", "body": bytes(body), "more_body": False}

        async def replay():
            nonlocal whole
            if whole is not None:
                msg, whole = whole, None
                return msg
            return await receive()         # (after the body: the disconnect, when it comes)
        return await self.app(scope, replay, send)

    def _too_large(self, length: int | None) -> str:
        size = f"{length} bytes" if length is not None else "more bytes"
        return f"request body of {size} > the limit of {self.max_bytes} (the STEP endpoint's max_frame_bytes)"


async def refuse(send, status: int, code: str, reason: str) -> None:
    """A refusal in the endpoint's one shape, {code, reason}, sent from the ASGI level."""
    body = json.dumps({"code": code, "reason": reason}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


_STATUS_CODES = {404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED"}


def build_app(endpoint: str, session_ttl_s: float = SESSION_TTL_S, max_body_bytes: int = DEFAULT_MAX_FRAME_BYTES,
              body_stall_s: float = BODY_STALL_S):
    """The Serve application for the STEP endpoint `endpoint` ("host:port", or the workers' endpoints
    comma-separated: each HTTP session's slots are then spread over them); run it with `serve.run(app,
    route_prefix=ROUTE)`."""
    from fastapi import Body, FastAPI, HTTPException
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from ray import serve
    from starlette.exceptions import HTTPException as StarletteHTTPException

    api = FastAPI(title="dspark-ray STEP over HTTP")
    api.add_middleware(BodyLimits, max_bytes=max_body_bytes, stall_s=body_stall_s)

    @api.exception_handler(StarletteHTTPException)
    async def flat(request, e):
        """Every refusal as {code, reason}: ours carry both, FastAPI's own (an unknown route) a status."""
        d = e.detail if isinstance(e.detail, dict) else {"code": _STATUS_CODES.get(e.status_code, "HTTP_ERROR"),
                                                         "reason": str(e.detail)}
        return JSONResponse(d, status_code=e.status_code)

    @api.exception_handler(RequestValidationError)
    async def malformed(request, e):
        """A body that is not JSON (or not an object) is refused as a schema error is: 422 BAD_REQUEST."""
        why = "; ".join(f"{'.'.join(str(x) for x in err.get('loc', ()))}: {err.get('msg')}" for err in e.errors())
        return JSONResponse({"code": "BAD_REQUEST", "reason": why or "malformed body"}, status_code=422)

    def refused(e: ClientError) -> HTTPException:
        return HTTPException(409, {"code": e.code.name if e.code is not None else "CONNECTION", "reason": str(e)})

    def refused_whole(code: Code, reason: str) -> HTTPException:
        """The contract's ErrorReply for a whole request: the code and reason TCP answers it with."""
        return HTTPException(409, {"code": code.name, "reason": reason})

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
            why = validate_step(Step(entries=entries, deadline_ms=msg.deadline_ms), c.limits)
            if why:                  # refused whole, as a front-end refuses the STEP frame (nothing runs)
                raise refused_whole(Code.BAD_ENTRY, why)
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


def start(name: str, endpoint: str, host: str, port: int, **limits) -> str:
    """Run the app for the pair `name` (its STEP endpoint `endpoint`) on Ray Serve's HTTP proxy at host:port (Serve
    is started there if it is not running yet; ProxyElsewhere, and nothing deployed, if it runs on another
    address); returns the sessions URL. `limits`: build_app's (session_ttl_s, max_body_bytes, body_stall_s)."""
    from ray import serve
    check_address(host, port)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(endpoint, **limits), name=f"{name}-http", route_prefix=ROUTE)
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

