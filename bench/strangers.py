"""What hostile or careless clients cost a deployed worker (issue 63): the front-end's memory while connections
announce 64 MiB frames and send a byte every few seconds, before HELLO and after it, and a normal STEP over HTTP while
other requests trickle their bodies. Deploys one tiny tp1 worker (gloo, CPU) with its HTTP app on a local Ray.

    python bench/strangers.py [--out FILE]

Each case: the front-end's RSS at rest, its peak while the case's connections trickle (sampled every 0.5 s for
`--hold-s`), how many of them the server closed and when. HTTP: a STEP's round trip at rest and while 20 requests
trickle their bodies (a call not answered within `--http-timeout-s` counts as that bound). The same file runs on a
tree without tokens (before issue 63: its API is detected), for the before / after.
"""
from __future__ import annotations

import argparse
import base64
import inspect
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench import report                            # noqa: E402
from dspark_ray.protocol import contract as C                 # noqa: E402
from dspark_ray.protocol import wire                         # noqa: E402

CLAIM = (64 << 20) - wire.HEADER_SIZE               # a payload length that makes a 64 MiB frame
MIB = 1 << 20


def header(mtype: C.MsgType, length: int) -> bytes:
    return wire.HEADER.pack(wire.MAGIC, C.PROTOCOL_VERSION, int(mtype), 0, 0, 1, length)


class Trickle:
    """`n` connections that each send `first` (after a HELLO when `hello` is given), then a byte every `every_s`."""

    def __init__(self, host: str, port: int, n: int, first: bytes, every_s: float, hello: bytes | None = None):
        self.socks, self.closed_at = [], {}
        self.t0 = time.monotonic()
        for _ in range(n):
            s = socket.create_connection((host, port), timeout=30)
            if hello is not None:
                s.sendall(hello)
                assert wire.FrameReader(s.recv_into).read().msg.ok
            s.sendall(first)
            s.setblocking(False)
            self.socks.append(s)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self.thread.start()

    def _run(self, every_s: float) -> None:
        """Look for the server's close every 0.1 s; send a byte every `every_s`."""
        next_byte = time.monotonic() + every_s
        while not self.stop.wait(0.1):
            send = time.monotonic() >= next_byte
            if send:
                next_byte += every_s
            for i, s in enumerate(self.socks):
                if i in self.closed_at:
                    continue
                try:
                    if s.recv(65536) == b"":
                        self.closed_at[i] = time.monotonic() - self.t0
                        continue
                except BlockingIOError:
                    pass
                except OSError:
                    self.closed_at[i] = time.monotonic() - self.t0
                    continue
                if send:
                    try:
                        s.send(b"\x00")
                    except OSError:
                        self.closed_at[i] = time.monotonic() - self.t0

    def close(self) -> dict:
        self.stop.set()
        self.thread.join()
        for s in self.socks:
            s.close()
        ts = sorted(self.closed_at.values())
        return {"connections": len(self.socks), "closed_by_server": len(ts),
                "closed_after_s": [round(ts[0], 2), round(ts[-1], 2)] if ts else None}


def rss_case(fe, what: str, make, hold_s: float) -> dict:
    import ray
    rest = statistics.median(ray.get(fe.status.remote(), timeout=30)["rss_bytes"] for _ in range(3))
    t = make()
    peak = rest
    t_end = time.monotonic() + hold_s
    while time.monotonic() < t_end:
        peak = max(peak, ray.get(fe.status.remote(), timeout=30)["rss_bytes"])
        time.sleep(0.5)
    out = {"case": what, "rss_at_rest_mib": round(rest / MIB, 1), "rss_peak_mib": round(peak / MIB, 1),
           "rss_added_mib": round((peak - rest) / MIB, 1), **t.close()}
    print(json.dumps(out), file=sys.stderr)
    return out


def http_call(url: str, body: dict, token: str | None, timeout_s: float) -> tuple[int, dict | None]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"} if token else {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def http_case(sessions_url: str, token: str | None, n_trickle: int, every_s: float, timeout_s: float) -> dict:
    """A STEP's round trip over HTTP at rest, then while `n_trickle` requests send their bodies a byte at a time."""
    st, opened = http_call(sessions_url, {"client": "bench"}, token, 60)
    url, lim = f"{sessions_url}/{opened['session']}", opened["limits"]
    (g,) = http_call(f"{url}/acquire", {"n": 1}, token, 60)[1]["slots"]
    taps = np.zeros((4, lim["n_taps"] * lim["hidden_size"]), "<f2")
    first = {"slot": g["slot"], "generation": g["generation"], "seed_token": 1, "start_pos": 0, "n_out": 5,
             "token_ids": [1, 2, 3, 4], "taps_b64": base64.b64encode(taps.tobytes()).decode()}
    assert http_call(f"{url}/step", {"entries": [first], "deadline_ms": 60_000}, token, 60)[0] == 200
    again = {"entries": [{"slot": g["slot"], "generation": g["generation"], "seed_token": 1, "start_pos": 4,
                          "n_out": 5}], "deadline_ms": 60_000}

    def timed() -> float:
        t = time.monotonic()
        try:
            http_call(f"{url}/step", again, token, timeout_s)
        except (TimeoutError, urllib.error.URLError):
            return timeout_s
        return time.monotonic() - t
    rest = [timed() for _ in range(10)]
    hostport, path = url.removeprefix("http://").split("/", 1)
    host, port = hostport.split(":")
    socks = []
    for _ in range(n_trickle):
        s = socket.create_connection((host, int(port)), timeout=30)
        s.sendall(f"POST /{path}/step HTTP/1.1\r\nHost: {hostport}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: 1000\r\n".encode() + (f"Authorization: Bearer {token}\r\n" if token else "")
                  .encode() + b"\r\n{")
        socks.append(s)
    stop = threading.Event()

    def trickle():
        while not stop.wait(every_s):
            for s in socks:
                try:
                    s.send(b" ")
                except OSError:
                    pass
    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    time.sleep(1.0)
    during = [timed() for _ in range(5)]
    stop.set()
    t.join()
    for s in socks:
        s.close()
    out = {"case": f"HTTP STEP, {n_trickle} bodies trickling a byte every {every_s:g} s",
           "at_rest": report.percentiles(rest, "ms", scale=1e3),
           "while_trickling": report.percentiles(during, "ms", scale=1e3),
           "calls_past_the_client_timeout": sum(d >= timeout_s for d in during), "client_timeout_s": timeout_s}
    print(json.dumps(out), file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trickle-s", type=float, default=3.0, help="seconds between a trickling peer's bytes")
    ap.add_argument("--hold-s", type=float, default=16.0, help="how long each TCP case is watched (past the 10 s "
                                                               "frame bound and a trickling peer's next byte)")
    ap.add_argument("--http-timeout-s", type=float, default=15.0)
    ap.add_argument("--out")
    a = ap.parse_args()
    import logging

    import ray
    from ray import serve

    from dspark_ray import http_gateway as http
    from dspark_ray.actors.placement import deploy, teardown
    from dspark_ray.config import tiny
    from dspark_ray.spec import PairSpec
    from dspark_ray.weights.synth import synthesize
    tokens = "token" in inspect.signature(deploy).parameters          # a tree after issue 63
    token = None
    if tokens:
        from dspark_ray.protocol.access_token import new_token
        token = new_token()
    ray.init(num_cpus=2, include_dashboard=False, namespace="dspark", log_to_driver=False,
             logging_level=logging.WARNING)
    ckpt = tempfile.mkdtemp(prefix="dsr-strangers-")
    result = {**report.header(__file__), "tokens": tokens, "cases": []}
    try:
        synthesize(tiny(), ckpt, seed=0)
        fe, endpoint = deploy(PairSpec(checkpoint=ckpt, tp=1, n_slots=4), name="strangers",
                              **({"token": token} if tokens else {}))
        host, port = endpoint.rsplit(":", 1)
        port = int(port)
        hello = wire.encode(C.Hello(client="bench", **({"token": token} if tokens else {})), 1)
        result["cases"].append(rss_case(fe, "16 strangers: a HELLO header claiming 64 MiB, then a byte every "
                                            f"{a.trickle_s:g} s", lambda: Trickle(
                                                host, port, 16, header(C.MsgType.HELLO, CLAIM), a.trickle_s), a.hold_s))
        result["cases"].append(rss_case(fe, "4 strangers: a STEP header claiming 64 MiB before HELLO", lambda: Trickle(
            host, port, 4, header(C.MsgType.STEP, CLAIM), a.trickle_s), a.hold_s))
        result["cases"].append(rss_case(fe, "16 sessions after HELLO: a STEP header claiming 64 MiB, then a byte "
                                            f"every {a.trickle_s:g} s", lambda: Trickle(
                                                host, port, 16, header(C.MsgType.STEP, CLAIM), a.trickle_s,
                                                hello=hello), a.hold_s))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            http_port = s.getsockname()[1]
        url = http.start("strangers", endpoint, "127.0.0.1", http_port, **({"token": token} if tokens else {}))
        result["cases"].append(http_case(url, token, 20, a.trickle_s, a.http_timeout_s))
    finally:
        http.stop("strangers")
        serve.shutdown()
        teardown("strangers")
        ray.shutdown()
        import shutil
        shutil.rmtree(ckpt, ignore_errors=True)
    report.write(result, a.out)


if __name__ == "__main__":
    main()
