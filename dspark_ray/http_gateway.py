"""STEP as JSON over HTTP through Ray Serve, for tools and engines that speak JSON (docs/operations.md, "HTTP"). A
round trip takes milliseconds: the per-round path is TCP or shm. Each HTTP session is one `DrafterPool`.

    POST   /v1/sessions                   {model_digest?, config_digest?, tp?, max_model_len?, client?}
                                          -> {session, limits, worker_generation, model_digest, ...}
    POST   /v1/sessions/{s}/acquire       {n}                    -> {slots: [{slot, generation}]}
    POST   /v1/sessions/{s}/release       {slots}                -> {released}
    POST   /v1/sessions/{s}/step          {entries, deadline_ms} -> {results}
    DELETE /v1/sessions/{s}                                      -> {closed}

An entry is the contract's Entry with `token_ids` a list and the fp16 taps as base64 of their LE bytes (`taps_b64`);
a body is as strict as a frame (required fields required, no coercion). A result: `code` (its name), `reason`,
`generation`, `drafts`, `confidences` (exact fp32 as JSON numbers), `margins` (or null), `confident_len`. A refusal
is {code, reason}: 401 UNAUTHORIZED (no `Authorization: Bearer TOKEN` with the deployment's token, judged before a
byte of the body is read); 409 the contract's refusal of a whole request (TCP's code and reason); 422 BAD_ENTRY (a
body that does not decode: not JSON, or off the schema; TCP's code for a payload that does not decode, its reason
naming the field in the JSON form: docs/contract.md, "Over HTTP"); 400 BAD_REQUEST (a Content-Length that is not a
number); 404 NO_SESSION / NOT_FOUND; 405 METHOD_NOT_ALLOWED; 413 TOO_LARGE (over
`max_body_bytes`, from the Content-Length before reading); 408 BODY_TIMEOUT (stalled `body_stall_s`, or not whole
within `body_timeout_s`). A body is read on the replica's event loop, so a slow one holds one of its
`MAX_ONGOING_REQUESTS`, not its threads; a session unused for `session_ttl_s` is closed when the next one opens.
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

from .protocol.access_token import token_refusal
from .client.drafter_client import ClientError
from .protocol.contract import Code, Step, make_entry, validate_step
from .client.pool import DrafterPool
from .protocol.wire import DEFAULT_MAX_FRAME_BYTES

ROUTE = "/dspark"
SESSION_TTL_S = 300.0
BODY_STALL_S = 5.0            # as TcpServer's stall_timeout_s: no progress for this long mid-request is a stall
BODY_TIMEOUT_S = 10.0         # as TcpServer's frame_timeout_s: a body's bound, however it trickles
# Requests the replica takes at once (Serve's default is 5: five trickling bodies held every other call); each slow
# body holds one until its bound. Measured in docs/operations.md, "Security".
MAX_ONGOING_REQUESTS = 128


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
    """A request body that breaks the contract's schema (HTTP 422 BAD_ENTRY, as TCP answers an undecodable payload)."""


def undecodable(what: str, why: str) -> BadBody:
    """TCP's words for a payload that does not decode (wire.decode_payload), for a body: the same msgspec error
    after them where the JSON form has the frame's field."""
    return BadBody(f"undecodable {what} body: {why}")


def parse_body(body, kind: type, what: str):
    """`body` (parsed JSON) as `kind`, or BadBody naming the field and the rule; `what`: the message type's name."""
    try:
        return msgspec.convert(body, kind)
    except msgspec.ValidationError as e:
        raise undecodable(what, str(e)) from None


def entry_from_json(e: dict | JsonEntry, i: int = 0):
    """The contract's Entry from its JSON form (entries[i] of a STEP), or BadBody (the taps' length is the
    contract's check)."""
    if not isinstance(e, JsonEntry):
        e = parse_body(e, JsonEntry, "STEP entry")
    try:
        taps = np.frombuffer(base64.b64decode(e.taps_b64, validate=True), dtype="<f2")
    except ValueError as x:      # binascii.Error is a ValueError; an odd byte count too
        raise undecodable("STEP", f"{x} - at `$.entries[{i}].taps_b64`") from None
    try:
        return make_entry(slot=e.slot, generation=e.generation, seed_token=e.seed_token, start_pos=e.start_pos,
                          token_ids=e.token_ids, taps=taps, rollback_to=e.rollback_to, n_out=e.n_out,
                          want_margins=e.want_margins)
    except ValueError as x:      # a token id beyond int32 (a cast would wrap it)
        raise undecodable("STEP", f"{x} - at `$.entries[{i}].token_ids`") from None


def result_to_json(r) -> dict:
    margins = r.margins_array()
    return {"code": Code(r.code).name, "reason": r.reason, "generation": r.generation,
            "drafts": r.drafts_array().tolist(), "confidences": r.confidences_array().tolist(),
            "margins": margins.tolist() if margins.size else None, "confident_len": r.confident_len}


def entry_to_json(slot: int, generation: int, seed_token: int, token_ids, taps, start_pos: int = 0,
                  rollback_to: int = -1, n_out: int = 5, want_margins: bool = False) -> dict:
    return {"slot": slot, "generation": generation, "seed_token": seed_token, "start_pos": start_pos,
            "token_ids": [int(t) for t in token_ids],
            "taps_b64": base64.b64encode(np.ascontiguousarray(taps, dtype="<f2").tobytes()).decode(),
            "rollback_to": rollback_to, "n_out": n_out, "want_margins": want_margins}


class _Sessions:
    """HTTP session token -> its DrafterPool (its slots over the deployment's workers); expired ones closed."""

    def __init__(self, endpoints: str, ttl_s: float, token: str | None = None):
        self.endpoints, self.ttl_s, self.token = endpoints, ttl_s, token
        self.lock = threading.Lock()
        self.clients: dict[str, tuple[DrafterPool, list[float]]] = {}

    def open(self, hello: JsonHello) -> tuple[str, object]:
        self.expire()
        c = DrafterPool(self.endpoints, timeout_s=30.0, token=self.token)
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


class BearerToken:
    """ASGI middleware: a request without `Authorization: Bearer TOKEN`, the deployment's token, is answered 401
    before a byte of its body is read (compared in constant time, never logged)."""

    def __init__(self, app, token: str):
        self.app, self.token = app, token

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, given = header.partition(" ")
        why = token_refusal(self.token, given.strip() if scheme.lower() == "bearer" else "",
                            "the request's Authorization: Bearer header")
        if why:
            return await refuse(send, 401, "UNAUTHORIZED", why, [(b"www-authenticate", b"Bearer")])
        return await self.app(scope, receive, send)


class BodyLimits:
    """ASGI middleware reading a body whole within `max_bytes` (413), `stall_s` without progress and `timeout_s` in
    all (408) before the app sees it: FastAPI would otherwise read, and parse, whatever came, for as long as it came."""

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_FRAME_BYTES, stall_s: float = BODY_STALL_S,
                 timeout_s: float = BODY_TIMEOUT_S):
        self.app, self.max_bytes, self.stall_s, self.timeout_s = app, max_bytes, stall_s, timeout_s

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
        deadline = time.monotonic() + self.timeout_s
        while more:
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise asyncio.TimeoutError
                msg = await asyncio.wait_for(receive(), min(self.stall_s, left))
            except asyncio.TimeoutError:
                of = f"{len(body)} of {length if length is not None else '?'} bytes"
                return await refuse(send, 408, "BODY_TIMEOUT", f"the request body stalled: {of}, then none for "
                                    f"{self.stall_s:g} s" if left > self.stall_s else
                                    f"the request body did not arrive within {self.timeout_s:g} s: {of}")
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
            return await receive()
        return await self.app(scope, replay, send)

    def _too_large(self, length: int | None) -> str:
        size = f"{length} bytes" if length is not None else "more bytes"
        return f"request body of {size} > the limit of {self.max_bytes} (the STEP endpoint's max_frame_bytes)"


async def refuse(send, status: int, code: str, reason: str, headers=()) -> None:
    """A refusal in the endpoint's one shape, {code, reason}, sent from the ASGI level."""
    body = json.dumps({"code": code, "reason": reason}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *headers]})
    await send({"type": "http.response.body", "body": body})


_STATUS_CODES = {404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED"}


def build_app(endpoint: str, session_ttl_s: float = SESSION_TTL_S, max_body_bytes: int = DEFAULT_MAX_FRAME_BYTES,
              body_stall_s: float = BODY_STALL_S, body_timeout_s: float = BODY_TIMEOUT_S, token: str | None = None,
              max_ongoing_requests: int = MAX_ONGOING_REQUESTS):
    """The Serve app for `endpoint` ("host:port", or the workers' comma-separated), to run at `ROUTE`; `token`: the
    deployment's, which every request must carry and the app's clients send (None: none)."""
    from fastapi import Body, FastAPI, HTTPException
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from ray import serve
    from starlette.exceptions import HTTPException as StarletteHTTPException

    api = FastAPI(title="dspark-ray STEP over HTTP")
    api.add_middleware(BodyLimits, max_bytes=max_body_bytes, stall_s=body_stall_s, timeout_s=body_timeout_s)
    if token is not None:                    # added last, so it runs first: before the body is read
        api.add_middleware(BearerToken, token=token)

    @api.exception_handler(StarletteHTTPException)
    async def flat(request, e):
        """Every refusal as {code, reason}: ours carry both, FastAPI's own (an unknown route) a status."""
        d = e.detail if isinstance(e.detail, dict) else {"code": _STATUS_CODES.get(e.status_code, "HTTP_ERROR"),
                                                         "reason": str(e.detail)}
        return JSONResponse(d, status_code=e.status_code)

    @api.exception_handler(RequestValidationError)
    async def malformed(request, e):
        """A body that is not JSON (or not an object) is refused as a schema error is: 422 BAD_ENTRY."""
        why = "; ".join(f"{'.'.join(str(x) for x in err.get('loc', ()))}: {err.get('msg')}" for err in e.errors())
        return JSONResponse({"code": "BAD_ENTRY", "reason": f"undecodable body: {why or 'malformed'}"},
                            status_code=422)

    def refused(e: ClientError) -> HTTPException:
        """A worker's refusal in its own words (TCP's reason), or the pool's where the pool refused."""
        return HTTPException(409, {"code": e.code.name if e.code is not None else "CONNECTION", "reason": e.reason})

    def refused_whole(code: Code, reason: str) -> HTTPException:
        return HTTPException(409, {"code": code.name, "reason": reason})

    def bad(e: ValueError) -> HTTPException:
        return HTTPException(422, {"code": Code.BAD_ENTRY.name, "reason": str(e)})

    @serve.deployment(num_replicas=1, max_ongoing_requests=max_ongoing_requests, ray_actor_options={"num_cpus": 0})
    @serve.ingress(api)
    class DrafterHttp:
        def __init__(self, endpoint: str, ttl_s: float, token: str | None):
            self.sessions = _Sessions(endpoint, ttl_s, token)

        def _client(self, s: str) -> DrafterPool:
            c = self.sessions.get(s)
            if c is None:
                raise HTTPException(404, {"code": "NO_SESSION", "reason": f"no session {s} (closed or expired)"})
            return c

        @api.post("/v1/sessions")
        def open_session(self, hello: dict = Body(default={})) -> dict:
            try:
                token, r = self.sessions.open(parse_body(hello, JsonHello, "HELLO"))
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
                grants = c.acquire(parse_body(body, JsonAcquire, "ACQUIRE").n)
            except BadBody as e:
                raise bad(e) from None
            except ClientError as e:
                raise refused(e) from None
            return {"slots": [{"slot": g.slot, "generation": g.generation} for g in grants]}

        @api.post("/v1/sessions/{s}/release")
        def release(self, s: str, body: dict = Body(...)) -> dict:
            c = self._client(s)
            try:
                return {"released": c.release(parse_body(body, JsonRelease, "RELEASE").slots)}
            except BadBody as e:
                raise bad(e) from None
            except ClientError as e:
                raise refused(e) from None

        @api.post("/v1/sessions/{s}/step")
        def step(self, s: str, body: dict = Body(...)) -> dict:
            c = self._client(s)
            try:
                msg = parse_body(body, JsonStep, "STEP")
                entries = [entry_from_json(e, i) for i, e in enumerate(msg.entries)]
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

    return DrafterHttp.bind(endpoint, session_ttl_s, token)


class ProxyElsewhere(RuntimeError):
    """Serve's HTTP proxy already runs in this cluster on another address (it cannot move)."""


def check_address(host: str, port: int) -> None:
    """ProxyElsewhere if Serve's proxy runs on another host:port (`serve.start` would only warn); call it before
    deploying anything, so a refusal changes nothing."""
    from ray.serve.context import _get_global_client
    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return
    have = client.http_config
    if (have.host, have.port) != (host, port):
        raise ProxyElsewhere(f"Ray Serve already runs its HTTP proxy on {have.host}:{have.port} in this cluster; "
                             f"ask for that address (--host {have.host} --http-port {have.port}) or stop Serve "
                             f"first (`serve shutdown`)")


def start(name: str, endpoint: str, host: str, port: int, **limits) -> str:
    """Run `name`'s app on Serve at host:port (`limits`: build_app's keywords, `token` among them); returns the
    sessions URL."""
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
        if _get_global_client(raise_if_no_controller_running=False) is None:
            return False
        if f"{name}-http" in serve.status().applications:
            serve.delete(f"{name}-http")
            return True
    except Exception:           # no Serve in this cluster (or not installed): nothing to stop
        pass
    return False

