"""A client written from docs/contract.md alone, against the real front-end (`StepService` before an in-process
engine, run as a rank runs it) over TCP: its frames are packed by hand (`struct`), its payloads are plain maps
through a generic MessagePack codec, and it imports nothing of dspark_ray's client side. Each step below is one rule
of the doc (the section in the comment); the drafts it gets are those of the project's own client (client/drafter_client.py) on a
twin worker, bit for bit."""
from __future__ import annotations

import socket
import struct

import msgspec
import numpy as np
import pytest

from dspark_ray.protocol import contract as C
from dspark_ray.client import DrafterClient
from dspark_ray.rank.engine import RankEngine
from dspark_ray.frontend.step_service import Identity, StepService
from dspark_ray.rank.modes import make_drafter
from dspark_ray.transport.tcp import TcpServer

from conftest import EnginePair

HEADER = struct.Struct("<4sHHHHQI")      # section 1: magic, version, type, flags, reserved, request id, length
VERSION = 2                              # section 8
HELLO, HELLO_REPLY, ACQUIRE, ACQUIRE_REPLY, RELEASE, RELEASE_REPLY, STEP, STEP_REPLY, ERROR_REPLY = range(1, 10)
OK, BAD_ENTRY, STALE_GENERATION, OVERLOADED, UNAUTHORIZED = 0, 1, 2, 6, 8
TOKEN = "a-deployment-token-for-the-doc-client"


class DocClient:
    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.next_id = 1

    def send(self, mtype: int, fields: dict, request_id: int | None = None) -> int:
        rid = self.next_id if request_id is None else request_id
        self.next_id += 1
        payload = msgspec.msgpack.encode(fields if "type" in fields else {"type": mtype, **fields})
        self.sock.sendall(HEADER.pack(b"DSPK", VERSION, mtype, 0, 0, rid, len(payload)) + payload)
        return rid

    def _exactly(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            got = self.sock.recv(n - len(buf))
            assert got, "the server closed the connection"
            buf += got
        return buf

    def receive(self) -> tuple[int, int, dict]:
        magic, version, mtype, flags, reserved, rid, length = HEADER.unpack(self._exactly(HEADER.size))
        assert (magic, version, flags, reserved) == (b"DSPK", VERSION, 0, 0)
        msg = msgspec.msgpack.decode(self._exactly(length))
        assert msg["type"] == mtype                     # the payload names its own type
        return mtype, rid, msg

    def call(self, mtype: int, fields: dict) -> tuple[int, dict]:
        rid = self.send(mtype, fields)
        got_type, got_rid, msg = self.receive()
        assert got_rid == rid
        return got_type, msg


def entry(slot: int, generation: int, start_pos: int, rows: int, n_out: int, width: int, seed: int = 0, **more):
    rng = np.random.default_rng(seed)
    taps = (0.5 * rng.standard_normal((rows, width))).astype("<f2")
    return {"slot": slot, "generation": generation, "seed_token": 7 + seed, "start_pos": start_pos, "n_out": n_out,
            "token_ids": (np.arange(rows, dtype="<i4") + 3 + seed).tobytes(), "taps": taps.tobytes(), **more}


@pytest.fixture
def worker(cfg, ckpt):
    def make():
        engine = RankEngine(make_drafter(cfg, "split", ckpt=ckpt), 4)
        svc = StepService(Identity("model", cfg.digest(), 2, cfg.max_model_len),
                          C.Limits.for_config(cfg, slot_capacity=4),
                          EnginePair(engine), window=cfg.sliding_window)
        return TcpServer(svc, token=TOKEN).start()
    made = [make(), make()]
    yield made
    for srv in made:
        srv.stop()


def test_a_client_written_from_the_doc_alone_is_served(worker, cfg):
    doc_srv, twin_srv = worker
    c = DocClient(doc_srv.port)
    # section 1: a HELLO without the deployment's token is answered UNAUTHORIZED, and the connection closed
    t, msg = c.call(HELLO, {"client": "doc"})
    assert t == HELLO_REPLY and msg["ok"] is False and msg["code"] == UNAUTHORIZED and msg["limits"] is None
    assert c.sock.recv(1) == b""
    c = DocClient(doc_srv.port)
    # section 2: HELLO, refused on a mismatch (and may be sent again), then accepted with the limits
    t, msg = c.call(HELLO, {"tp": 1, "token": TOKEN})
    assert t == HELLO_REPLY and msg["ok"] is False and msg["code"] == 3 and msg["limits"] is None
    t, msg = c.call(HELLO, {"client": "doc", "config_digest": cfg.digest(), "tp": 2, "token": TOKEN})
    assert t == HELLO_REPLY and msg["ok"] is True and msg["code"] == OK and msg["worker_generation"] == 0
    lim = msg["limits"]
    assert lim["sliding_window"] == cfg.sliding_window and lim["slot_capacity"] == 4
    width, W, L = lim["n_taps"] * lim["hidden_size"], lim["sliding_window"], lim["max_model_len"]

    # section 3: ACQUIRE n outside 1..slot_capacity is BAD_ENTRY; within it but more than free, OVERLOADED
    for n in (0, 5, (1 << 64) - 1):
        t, msg = c.call(ACQUIRE, {"n": n})
        assert t == ERROR_REPLY and msg["code"] == BAD_ENTRY and f"n {n}" in msg["reason"]
    t, msg = c.call(ACQUIRE, {"n": 2})
    assert t == ACQUIRE_REPLY
    (a, ga), (b, gb) = [(g["slot"], g["generation"]) for g in msg["slots"]]
    assert ga == gb == 1                                # a first grant carries 1
    t, msg = c.call(ACQUIRE, {"n": 3})
    assert t == ERROR_REPLY and msg["code"] == OVERLOADED

    # section 4: a fresh slot's first insert anywhere (one window), then the next round at the slot's position,
    # then a rollback; drafts int32 x n_out, confidences fp32 x n_out, margins only when asked
    rounds = [[entry(a, ga, 1000, W, 5, width, 0, want_margins=True)],
              [entry(a, ga, 1000 + W, 2, 3, width, 1)],
              [entry(a, ga, 0, 0, 5, width, 2), entry(a, ga, 0, 0, 3, width, 2)],   # slot named twice: refused
              [entry(a, ga, 0, 0, 5, width, 3)],
              [entry(a, ga, 0, 0, 2, width, 3)],                  # the same seed and context, 2 drafts
              [entry(a, ga, 1000 + W + 1, 1, 4, width, 5, rollback_to=1000 + W + 1)]]
    got = []
    for k, entries in enumerate(rounds):
        t, msg = c.call(STEP, {"entries": entries, "deadline_ms": 60_000.0})
        assert t == STEP_REPLY and len(msg["results"]) == len(entries)
        got.append(msg["results"])
    for r, e in zip([rs[0] for rs in got], [es[0] for es in rounds]):
        assert r["code"] == OK and r["generation"] == ga, r["reason"]
        assert len(r["drafts"]) == 4 * e["n_out"] and len(r["confidences"]) == 4 * e["n_out"]
        assert len(r["margins"]) == (4 * e["n_out"] if e.get("want_margins") else 0)
        assert 0 <= r["confident_len"] <= e["n_out"]
    assert got[2][1]["code"] == BAD_ENTRY and "named by entries 0 and 1" in got[2][1]["reason"]
    assert got[4][0]["drafts"] == got[3][0]["drafts"][:8]           # the prefix property, bit for bit
    # the project's own client, on a twin worker, gets the same bits
    with DrafterClient("127.0.0.1", twin_srv.port, token=TOKEN) as own:
        own.hello()
        [g, _] = own.acquire(2)
        for entries, results in zip(rounds, got):
            e = entries[0]
            fields = {**e, "slot": g.slot, "generation": g.generation}
            [r] = own.step([C.Entry(**fields)], deadline_ms=60_000.0)
            assert (bytes(r.drafts), bytes(r.confidences), bytes(r.margins)) == (
                results[0]["drafts"], results[0]["confidences"], results[0]["margins"])

    # section 4: no row and no draft at a position >= max_model_len
    t, msg = c.call(STEP, {"entries": [entry(b, gb, L - 1, 1, 5, width)], "deadline_ms": 1000.0})
    assert msg["results"][0]["code"] == BAD_ENTRY and f"max_model_len {L}" in msg["results"][0]["reason"]
    # section 3: another generation is STALE_GENERATION, with the current one in the answer
    t, msg = c.call(STEP, {"entries": [entry(b, gb + 5, 0, 0, 1, width)], "deadline_ms": 1000.0})
    assert msg["results"][0]["code"] == STALE_GENERATION and msg["results"][0]["generation"] == gb
    # section 1: a payload that breaks the schema is answered BAD_ENTRY and the session goes on
    no_n_out = {k: v for k, v in entry(b, gb, 0, 0, 1, width).items() if k != "n_out"}
    t, msg = c.call(STEP, {"entries": [no_n_out], "deadline_ms": 1000.0})
    assert t == ERROR_REPLY and msg["code"] == BAD_ENTRY and "n_out" in msg["reason"]
    t, msg = c.call(STEP, {"entries": [entry(b, gb, 0, 0, 1, width, unknown=1)], "deadline_ms": 1000.0})
    assert t == ERROR_REPLY and msg["code"] == BAD_ENTRY and "unknown" in msg["reason"]
    t, msg = c.call(STEP, {"entries": [entry(b, gb, 5, 1, 1, width)]})            # no deadline
    assert t == ERROR_REPLY and "deadline_ms" in msg["reason"]
    # section 1: pipelined requests are answered in order, each with its id
    ids = [c.send(STEP, {"entries": [entry(b, gb, 50 + k, 1, 1, width, k)], "deadline_ms": 60_000.0})
           for k in range(3)]
    answers = [c.receive() for _ in ids]
    assert [rid for _, rid, _ in answers] == ids and all(m["results"][0]["code"] == OK for _, _, m in answers)
    # section 3: RELEASE answers the slots this session held; others are left out
    t, msg = c.call(RELEASE, {"slots": [b, a, 3, 999, a]})
    assert t == RELEASE_REPLY and msg["released"] == [b, a]
    c.sock.close()
