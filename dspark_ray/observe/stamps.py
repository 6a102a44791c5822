"""Per-step timestamps on the host path: where a STEP's round trip goes, hop by hop. CLOCK_MONOTONIC is one clock
for every process of a host, so stamps from different processes line up (`bench/step_latency.py` joins them).
A party built without a recorder (recorders.py) stamps nothing.
"""
from __future__ import annotations

import collections
import time

from ..settings import current as settings

now = time.monotonic_ns
# DSPARK_STAMP_CPU=1: thread CPU time beside some stamps, so a slow hop shows whether its thread worked or waited.
cpu_now = time.thread_time_ns if settings().stamp_cpu else int


class Stamps:
    """The last `maxlen` steps' stamps of one party: one dict (stamp name -> ns, plus join keys) per step."""

    def __init__(self, maxlen: int = 2000):
        self.rows: collections.deque[dict] = collections.deque(maxlen=maxlen)

    def add(self, row: dict) -> None:
        self.rows.append(row)

    def recent(self) -> list[dict]:
        return list(self.rows)


# (hop, from stamp, to stamp) in path order; "rank_*" is the rank whose completion came last. A party stamps before
# it hands a step on, so a hop between processes never reads negative.
HOPS = (("client_to_server", "client_send", "tcp_recv"),      # client encode, TCP loopback up to the header
        ("frame_read", "tcp_recv", "tcp_read"),               # payload received, decoded
        ("checks", "tcp_read", "svc_admitted"),               # contract checks, slot admission
        ("to_batch", "svc_admitted", "ring_publish"),         # queue, batch built
        ("encode_batch", "ring_publish", "ring_posting"),     # batch encoded
        ("ring_out", "ring_posting", "rank_got"),             # copied into the ring slot, seen by a spinning rank
        ("rank_decode", "rank_got", "rank_engine_in"),        # decode, resets, entries
        ("rank_reset", "rank_engine_in", "rank_started"),     # the batch's slot resets
        ("rank_prepare", "rank_started", "rank_run_in"),      # the slots placed, the graph set's arguments
        ("rank_writable", "rank_run_in", "rank_writable"),    # the last upload has left the pinned buffer
        ("rank_stage_insert", "rank_writable", "rank_first_launch"),  # the inserted rows' inputs and taps
        ("rank_launch_insert", "rank_first_launch", "rank_insert_launched"),  # the insert replay launched
        ("rank_stage_draft", "rank_insert_launched", "rank_draft_staged"),  # the draft's inputs (GPU on the inserts)
        ("rank_launch_draft", "rank_draft_staged", "rank_launched"),  # the draft replay launched
        ("rank_gpu", "rank_launched", "rank_synced"),         # the rest of the GPU work, until the sync returns
        ("rank_unpack", "rank_synced", "rank_ran"),           # the outputs read from the download
        ("rank_finish", "rank_ran", "rank_engine_out"),       # answers, the collectives' fail-closed check
        ("rank_encode", "rank_engine_out", "rank_encoded"),   # rank 0's results encoded
        ("ring_back", "rank_encoded", "ring_completions"),    # completion posted, seen by the front-end
        ("results", "ring_completions", "svc_reply"),         # results decoded, cursors advanced, reply built
        ("reply_send", "svc_reply", "tcp_sent"),              # reply encoded, sent
        ("server_to_client", "tcp_sent", "client_recv"))      # TCP loopback back, client decode
RANK_PHASES = (("decode", "got", "engine_in"), ("reset", "engine_in", "started"), ("run", "started", "ran"),
               ("finish", "ran", "engine_out"), ("engine_step", "engine_in", "engine_out"))


# Hops that one thread runs from end to end and that carry CPU stamps at both ends (with DSPARK_STAMP_CPU=1).
CPU_HOPS = (("checks", "tcp_read", "svc_admitted"), ("results", "ring_completions", "svc_reply"),
            ("rank_decode", "rank_got", "rank_engine_in"), ("rank_encode", "rank_engine_out", "rank_encoded"))


def join_round_trips(client: list[tuple[int, int]], st: dict) -> list[dict]:
    """One dict per round trip of one client (one entry per STEP): the client's i-th STEP is the server's i-th, the
    service's row has the server's frame arrival time, the ring's and the ranks' rows its seq."""
    svc = {r["recv"]: r for r in st["service"]}
    ring = {r["seq"]: r for r in st["ring"]}
    ranks = [{r["seq"]: r for r in rows} for rows in st["ranks"]]
    out = []
    n = min(len(client), len(st["tcp"]))          # each party keeps its last Stamps.maxlen steps
    for (sent, recv), t in zip(client[-n:], st["tcp"][-n:]):
        v = svc[t["recv"]]
        g = ring[v["seq"]]
        rs = [rk[v["seq"]] for rk in ranks]
        row = {"client_send": sent, "client_recv": recv, **{f"tcp_{k}": t[k] for k in t},
               **{f"svc_{k}": v[k] for k in v if k != "seq"}, **{f"ring_{k}": g[k] for k in g if k != "seq"}}
        crit = max(range(len(rs)), key=lambda r: rs[r]["encoded"])
        for r, x in enumerate(rs):
            row.update({f"r{r}_{k}": x[k] for k in x if k != "seq"})
        row.update({f"rank_{k}": rs[crit][k] for k in rs[crit] if k != "seq"})
        out.append(row)
    return out
