"""The HTTP endpoint's bounds and refusals (http_gateway.py, issues 51 and 63): a request without the deployment's
token is refused 401 before its body is read, a body over the TCP frame limit 413 before it is read, a stalled or slow
body 408, and slow bodies do not hold the replica from others; every refusal is {code, reason}, and a bad STEP is
refused over HTTP exactly as over TCP. The middleware alone (no Ray), then the app on Ray Serve in front of a tiny
tp1 worker."""
from __future__ import annotations

import asyncio
import base64
import json
import math
import socket
import statistics
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from dspark_ray.protocol import access_token
from dspark_ray.protocol import contract as C
from dspark_ray.protocol import wire
from dspark_ray import http_gateway as http
from dspark_ray.protocol.wire import DEFAULT_MAX_FRAME_BYTES

STALL_S = 1.0
BODY_TIMEOUT_S = 4.0
TOKEN = access_token.new_token()
BEARER = {"Authorization": f"Bearer {TOKEN}"}


# ---- the body's bounds, at the ASGI level -------------------------------------------------------------------------
def through_limits(chunks, content_length=None, max_bytes=1000, stall_s=0.2, timeout_s=10.0, gap_s=0.0,
                   headers=(), token=None):
    """Send a POST whose body comes in `chunks`, `gap_s` apart (a None chunk: the client stops sending), through
    BodyLimits (and BearerToken when `token` is set) in front of an app that echoes the body's length; returns
    (status, JSON answer, what the app saw, chunks read)."""
    seen, read = [], [0]

    async def app(scope, receive, send):
        msg = await receive()
        seen.append(msg["body"])
        body = json.dumps({"length": len(msg["body"])}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        for i, c in enumerate(chunks):
            if c is not None:
                queue.put_nowait({"type": "http.request", "body": c, "more_body": i < len(chunks) - 1})

        async def receive():
            read[0] += 1
            await asyncio.sleep(gap_s)
            return await queue.get()                 # a client that stopped sending: waits for ever
        sent = []

        async def send(m):
            sent.append(m)
        head = list(headers) + ([] if content_length is None else [(b"content-length", str(content_length).encode())])
        limits = http.BodyLimits(app, max_bytes, stall_s, timeout_s)
        outer = limits if token is None else http.BearerToken(limits, token)
        await outer({"type": "http", "method": "POST", "headers": head}, receive, send)
        return sent[0]["status"], json.loads(sent[1]["body"])
    status, answer = asyncio.run(run())
    return status, answer, seen, read[0]


def test_a_body_within_the_limit_reaches_the_app_whole():
    status, answer, seen, _ = through_limits([b"a" * 400, b"b" * 600], content_length=1000)
    assert (status, answer, seen) == (200, {"length": 1000}, [b"a" * 400 + b"b" * 600])


def test_a_body_announced_over_the_limit_is_refused_413_without_reading_a_byte():
    status, answer, seen, read = through_limits([b"x" * 10], content_length=1 << 30)
    assert status == 413 and answer["code"] == "TOO_LARGE" and "1073741824 bytes > the limit of 1000" in \
        answer["reason"] and seen == [] and read == 0


def test_a_body_without_a_length_is_refused_413_once_it_passes_the_limit():
    status, answer, seen, read = through_limits([b"x" * 600, b"x" * 600] + [b"x" * 600] * 100)
    assert status == 413 and answer["code"] == "TOO_LARGE" and seen == [] and read == 2


def test_a_stalled_body_is_refused_408_after_the_stall_bound():
    t0 = time.monotonic()
    status, answer, seen, _ = through_limits([b"x" * 300, None], content_length=1000, stall_s=0.2)
    assert status == 408 and answer["code"] == "BODY_TIMEOUT" and seen == []
    assert "300 of 1000 bytes, then none for 0.2 s" in answer["reason"] and time.monotonic() - t0 < 2.0


def test_a_trickling_body_is_refused_408_at_its_total_bound():
    """A chunk every 0.1 s never stalls (0.2 s), yet the body is cut at its 0.5 s bound."""
    t0 = time.monotonic()
    status, answer, seen, read = through_limits([b"x"] * 100, content_length=100, stall_s=0.2, timeout_s=0.5,
                                                gap_s=0.1)
    assert status == 408 and answer["code"] == "BODY_TIMEOUT" and seen == [] and 3 <= read < 10
    assert "did not arrive within 0.5 s" in answer["reason"] and 0.45 < time.monotonic() - t0 < 2.0


@pytest.mark.parametrize("headers,why", [
    ((), "carries none"), (((b"authorization", b"Bearer " + b"x" * 43),), "is not this deployment's"),
    (((b"authorization", f"Bearer {access_token.new_token()}".encode()),), "is not this deployment's"),
    (((b"authorization", f"Basic {TOKEN}".encode()),), "carries none"),
], ids=["none", "wrong", "another-deployments", "not-bearer"])
def test_a_request_without_the_token_is_refused_401_before_a_byte_of_its_body(headers, why):
    status, answer, seen, read = through_limits([b"x" * 10], content_length=10, headers=headers, token=TOKEN)
    assert status == 401 and answer["code"] == "UNAUTHORIZED" and why in answer["reason"], answer
    assert TOKEN not in answer["reason"] and seen == [] and read == 0
    ok = through_limits([b"x" * 10], content_length=10, token=TOKEN,
                        headers=[(b"authorization", f"Bearer {TOKEN}".encode())])
    assert ok[:2] == (200, {"length": 10})


# ---- the app on Ray Serve -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(ray_cluster, tiny_ckpt):
    """A tiny tp1 worker with its HTTP app (a 1 s body stall bound, to keep the test short): (TCP host, port,
    the sessions URL)."""
    from ray import serve

    from conftest import deploy_pair
    from dspark_ray.actors.placement import teardown
    _, host, port = deploy_pair(ray_cluster, tiny_ckpt, "http", tp=1, token=TOKEN)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        http_port = s.getsockname()[1]
    try:
        yield host, port, http.start("http", f"{host}:{port}", "127.0.0.1", http_port, body_stall_s=STALL_S,
                                     body_timeout_s=BODY_TIMEOUT_S, token=TOKEN)
    finally:
        http.stop("http")
        serve.shutdown()
        teardown("http")


def call(method: str, url: str, body=None, raw: bytes | None = None, auth: dict = BEARER) -> tuple[int, dict]:
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, method=method, data=data, headers={"Content-Type": "application/json", **auth})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def session(served) -> str:
    st, opened = call("POST", served[2], {"client": "http limits test"})
    assert st == 200, opened
    return f"{served[2]}/{opened['session']}"


def raw_post(url: str, headers: dict, body: bytes, read_s: float) -> tuple[int, dict, float]:
    """POST `body` under `headers` on a raw socket (it may be less than the Content-Length says), then read the
    answer: (status, its JSON, seconds from the last byte sent to the answer)."""
    hostport, path = url.removeprefix("http://").split("/", 1)
    host, port = hostport.split(":")
    with socket.create_connection((host, int(port)), timeout=read_s) as s:
        head = f"POST /{path} HTTP/1.1\r\nHost: {hostport}\r\nContent-Type: application/json\r\n" + \
            "".join(f"{k}: {v}\r\n" for k, v in {**BEARER, **headers}.items()) + "\r\n"
        s.sendall(head.encode() + body)
        t0 = time.monotonic()
        got = b""
        while b"\r\n\r\n" not in got or len(got.split(b"\r\n\r\n", 1)[1]) < _length(got):
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    took = time.monotonic() - t0
    head, _, payload = got.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload[:_length(got)]), took


def _length(got: bytes) -> int:
    for line in got.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 1 << 30


def test_a_body_over_the_tcp_frame_limit_is_refused_413_before_it_is_sent(served):
    """A STEP announcing a 1 GiB body: answered 413 TOO_LARGE (the limit is the STEP endpoint's frame limit) with
    only 64 KiB of it sent, at once; the session still serves."""
    url = session(served)
    st, got, took = raw_post(f"{url}/step", {"Content-Length": str(1 << 30)}, b"{" + b" " * (64 << 10), 30)
    assert st == 413 and got["code"] == "TOO_LARGE" and f"the limit of {DEFAULT_MAX_FRAME_BYTES}" in got["reason"]
    assert took < 10, took
    st, got = call("POST", f"{url}/acquire", {"n": 1})
    assert st == 200 and len(got["slots"]) == 1, got


def test_a_stalled_body_is_refused_408_and_its_connection_freed(served):
    url = session(served)
    st, got, took = raw_post(f"{url}/step", {"Content-Length": "1000"}, b'{"deadline_ms": 100', 30)
    assert st == 408 and got["code"] == "BODY_TIMEOUT" and "19 of 1000 bytes" in got["reason"], got
    assert STALL_S * 0.9 < took < STALL_S + 10, took
    assert call("POST", f"{url}/acquire", {"n": 1})[0] == 200


def test_every_refusal_is_a_code_and_a_reason(served):
    url = session(served)
    cases = {
        "not JSON": ("POST", f"{url}/step", None, b"{not json", 422, "BAD_ENTRY"),
        "not an object": ("POST", f"{url}/acquire", None, b"[1, 2]", 422, "BAD_ENTRY"),
        "a missing field": ("POST", f"{url}/step", {"entries": []}, None, 422, "BAD_ENTRY"),
        "an unknown session": ("POST", f"{served[2]}/nope/acquire", {"n": 1}, None, 404, "NO_SESSION"),
        "an unknown route": ("POST", f"{url}/no/such/route", {}, None, 404, "NOT_FOUND"),
        "a wrong method": ("GET", f"{url}/step", None, None, 405, "METHOD_NOT_ALLOWED"),
        "a refused request": ("POST", f"{url}/acquire", {"n": 99}, None, 409, "BAD_ENTRY"),
    }
    for what, (method, u, body, raw, status, code) in cases.items():
        st, got = call(method, u, body, raw)
        assert (st, got.get("code")) == (status, code) and set(got) == {"code", "reason"} and got["reason"], \
            (what, st, got)


def tcp_answer(host: str, port: int, msg) -> object:
    """`msg`'s answer from the STEP endpoint, sent as it is (no client-side splitting or checks) after HELLO."""
    with socket.create_connection((host, port), timeout=60) as s:
        reader = wire.FrameReader(s.recv_into)
        for i, m in enumerate((C.Hello(client="tcp side", token=TOKEN), msg)):
            s.sendall(wire.encode(m, i + 1))
            _, reply, _ = reader.read()
        return reply


def test_a_bad_step_is_refused_over_http_exactly_as_over_tcp(served):
    """Each STEP-level refusal (a NaN, 0, negative or infinite deadline; more entries than max_entries_per_step)
    and the empty STEP, sent over both: the same code and reason (HTTP 409 {code, reason} for TCP's ErrorReply),
    the same empty results for the empty STEP."""
    host, port, _ = served
    url = session(served)
    one = {"slot": 0, "generation": 0, "seed_token": 1, "start_pos": 0, "n_out": 1}
    limit = call("POST", served[2], {})[1]["limits"]["max_entries_per_step"]
    cases = {"NaN deadline": ([], math.nan), "zero deadline": ([], 0.0), "negative deadline": ([one], -1.0),
             "infinite deadline": ([one], math.inf), f"{limit + 1} entries": ([one] * (limit + 1), 100.0),
             "empty STEP": ([], 100.0)}
    for what, (entries, deadline) in cases.items():
        tcp = tcp_answer(host, port, C.Step(entries=[C.make_entry(**e) for e in entries], deadline_ms=deadline))
        st, got = call("POST", f"{url}/step", raw=json.dumps({"entries": entries, "deadline_ms": deadline}).encode())
        if isinstance(tcp, C.ErrorReply):
            assert st == 409 and (got["code"], got["reason"]) == (tcp.code.name, tcp.reason), (what, tcp, got)
        else:
            assert isinstance(tcp, C.StepReply) and tcp.results == [] and (st, got) == (200, {"results": []}), \
                (what, tcp, got)


def tcp_raw_answer(host: str, port: int, fields: dict) -> object:
    """The answer to a payload as it is (`fields`, its `type` among them, which need not decode), after HELLO."""
    import msgspec
    payload = msgspec.msgpack.encode(fields)
    frame = wire.HEADER.pack(wire.MAGIC, C.PROTOCOL_VERSION, fields["type"], 0, 0, 2, len(payload)) + payload
    with socket.create_connection((host, port), timeout=60) as s:
        reader = wire.FrameReader(s.recv_into)
        s.sendall(wire.encode(C.Hello(client="tcp side", token=TOKEN), 1))
        reader.read()
        s.sendall(frame)
        return reader.read()[1]


def test_http_refuses_a_bad_request_with_tcps_code_and_reason(served):
    """The same bad requests over both (issue 64): a payload that does not decode is BAD_ENTRY on both (HTTP 422),
    with the same decoder's words for the field after "undecodable STEP payload (N bytes): " / "undecodable STEP
    body: "; ACQUIRE n over the capacity or under 1 and a HELLO for another tp are HTTP 409 with TCP's code and
    reason, word for word."""
    import msgspec
    host, port, sessions = served
    url = session(served)
    st, opened = call("POST", sessions, {})
    capacity = opened["limits"]["slot_capacity"]
    one = {"slot": 0, "generation": 0, "seed_token": 1, "start_pos": 0, "n_out": 1}

    def tcp_step(entry: dict, **top) -> dict:
        d = msgspec.msgpack.decode(msgspec.msgpack.encode(C.Step(entries=[C.make_entry(**one)], deadline_ms=100.0)))
        d["entries"][0].update(entry)
        return {k: v for k, v in {**d, **top}.items() if v is not None}
    undecodable = {     # what: (TCP payload, HTTP route, HTTP body)
        "a slot that is a string": (tcp_step({"slot": "0"}), "step",
                                    {"entries": [{**one, "slot": "0"}], "deadline_ms": 100.0}),
        "no deadline": (tcp_step({}, deadline_ms=None), "step", {"entries": [one]}),
        "an unknown entry field": (tcp_step({"temperature": 0.5}), "step",
                                   {"entries": [{**one, "temperature": 0.5}], "deadline_ms": 100.0}),
        "an ACQUIRE with an unknown field": ({"type": int(C.MsgType.ACQUIRE), "n": 1, "pool": "a"}, "acquire",
                                             {"n": 1, "pool": "a"}),
        "n that is a float": ({"type": int(C.MsgType.ACQUIRE), "n": 1.5}, "acquire", {"n": 1.5}),
    }
    for what, (fields, route, body) in undecodable.items():
        tcp = tcp_raw_answer(host, port, fields)
        st, got = call("POST", f"{url}/{route}", body)
        kind = C.MsgType(fields["type"]).name
        assert isinstance(tcp, C.ErrorReply) and tcp.reason.startswith(f"undecodable {kind} payload ("), (what, tcp)
        assert got["reason"].startswith(f"undecodable {kind} body: "), (what, got)
        assert (st, got["code"]) == (422, tcp.code.name) and \
            got["reason"].split(" body: ", 1)[1] == tcp.reason.split(" bytes): ", 1)[1], (what, tcp, got)
    for n in (capacity + 1, 0):
        tcp = tcp_answer(host, port, C.Acquire(n=n))
        st, got = call("POST", f"{url}/acquire", {"n": n})
        assert isinstance(tcp, C.ErrorReply) and (st, got) == (409, {"code": tcp.code.name, "reason": tcp.reason}), \
            (n, tcp, got)
    with socket.create_connection((host, port), timeout=60) as s:
        s.sendall(wire.encode(C.Hello(client="tcp side", token=TOKEN, tp=opened["tp"] + 1), 1))
        tcp = wire.FrameReader(s.recv_into).read()[1]
    st, got = call("POST", sessions, {"tp": opened["tp"] + 1})
    assert not tcp.ok and (st, got) == (409, {"code": tcp.code.name, "reason": tcp.reason}), (tcp, got)
    assert got["code"] == "CONFIG_MISMATCH" and got["reason"].startswith("tp: client expects "), got


# ---- who may draft over HTTP, and slow bodies (issue 63) ----------------------------------------------------------
def drafting_session(served) -> tuple[str, dict]:
    """A session holding one slot with 4 rows inserted: (its URL, a STEP that drafts again from them, changing
    nothing: its answer is the same every time)."""
    st, opened = call("POST", served[2], {"client": "drafting"})
    assert st == 200, opened
    url, lim = f"{served[2]}/{opened['session']}", opened["limits"]
    st, got = call("POST", f"{url}/acquire", {"n": 1})
    (g,) = got["slots"]
    rng = np.random.default_rng(5)
    taps = rng.standard_normal((4, lim["n_taps"] * lim["hidden_size"])).astype("<f2")
    first = {"slot": g["slot"], "generation": g["generation"], "seed_token": 1, "start_pos": 0, "n_out": 5,
             "token_ids": [int(t) for t in rng.integers(0, lim["vocab_size"], 4)],
             "taps_b64": base64.b64encode(taps.tobytes()).decode()}
    st, got = call("POST", f"{url}/step", {"entries": [first], "deadline_ms": 60_000})
    assert st == 200 and got["results"][0]["code"] == "OK", got
    again = {"slot": g["slot"], "generation": g["generation"], "seed_token": 1, "start_pos": 4, "n_out": 5}
    return url, {"entries": [again], "deadline_ms": 60_000}


def drafts(url: str, step: dict) -> list[int]:
    st, got = call("POST", f"{url}/step", step)
    assert st == 200 and got["results"][0]["code"] == "OK", got
    return got["results"][0]["drafts"]


def test_http_requests_without_the_token_are_refused_401_and_a_holders_drafts_are_unchanged(served):
    """No Authorization header, a wrong token, another deployment's, the token in the body instead of the header:
    401 UNAUTHORIZED for opening a session and for a STEP; the holder's session drafts the same throughout."""
    url, step = drafting_session(served)
    want = drafts(url, step)
    for auth in ({}, {"Authorization": "Bearer " + "x" * 43}, {"Authorization": f"Bearer {access_token.new_token()}"}):
        for target, body in ((served[2], {"client": "stranger"}), (f"{url}/step", step),
                             (served[2], {"client": "stranger", "token": TOKEN})):
            st, got = call("POST", target, body, auth=auth)
            assert (st, got["code"]) == (401, "UNAUTHORIZED") and TOKEN not in got["reason"], (auth, target, got)
        assert drafts(url, step) == want


def test_twenty_trickling_bodies_leave_a_step_answered_in_its_usual_time(served):
    """20 token holders send STEP bodies a byte every 0.5 s (never a stall): meanwhile STEPs are answered, all of
    them before the first trickler is refused (408 at its 4 s bound), in about their usual time. Serve's default of
    5 requests a replica held every other call until the bodies' bound."""
    url, step = drafting_session(served)

    def timed() -> float:
        t = time.monotonic()
        drafts(url, step)
        return time.monotonic() - t
    usual = statistics.median(timed() for _ in range(5))
    hostport, path = f"{url}/step".removeprefix("http://").split("/", 1)
    host, port = hostport.split(":")
    answers: list[tuple[float, bytes]] = []
    lock, started = threading.Lock(), threading.Semaphore(0)

    def trickle():
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(f"POST /{path} HTTP/1.1\r\nHost: {hostport}\r\nContent-Type: application/json\r\n"
                      f"Authorization: Bearer {TOKEN}\r\nContent-Length: 1000\r\n\r\n{{".encode())
            started.release()
            s.settimeout(0.5)
            while True:
                try:
                    got = s.recv(65536)
                    break
                except TimeoutError:
                    s.sendall(b" ")
            when = time.monotonic()
            s.settimeout(30)
            while chunk := s.recv(65536):          # the answer, to the server's close
                got += chunk
            with lock:
                answers.append((when, got))
    threads = [threading.Thread(target=trickle) for _ in range(20)]
    for t in threads:
        t.start()
    for _ in threads:
        assert started.acquire(timeout=30)
    time.sleep(1.0)                                    # every body is under way
    during = [timed() for _ in range(5)]
    answered = time.monotonic()
    for t in threads:
        t.join(BODY_TIMEOUT_S + 30)
    assert len(answers) == 20 and all(b" 408 " in got.split(b"\r\n")[0] and b"BODY_TIMEOUT" in got
                                      for _, got in answers), answers
    assert min(when for when, _ in answers) > answered            # the STEPs did not wait for the tricklers
    print(f"STEP over HTTP: usual {usual * 1e3:.1f} ms; with 20 trickling bodies p50 "
          f"{statistics.median(during) * 1e3:.1f} ms, max {max(during) * 1e3:.1f} ms")
    assert statistics.median(during) < usual + 0.5, (usual, during)
