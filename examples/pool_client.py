"""What a serving engine embeds in front of several workers (`dspark-ray serve --pairs N`): one DrafterPool, its
requests' slots spread over the workers, one STEP per decode round. A request whose worker went away answers
UNAVAILABLE; the engine verifies that round without drafts, takes a new slot (on a worker that serves) and inserts
the request's context there. Run against running workers:
    python examples/pool_client.py HOST:PORT,HOST:PORT --token-file TOKEN_FILE [--deadline-ms MS]
(--token-file and --deadline-ms as in examples/client.py: default 1000 ms, which fits the tiny drafter on a CPU.
`DrafterPool.from_deployment(HEAD:6379, NAME)` finds the workers and the token by the deployment's name instead.)
"""
import argparse

import numpy as np

from dspark_ray.protocol.access_token import read_token_file
from dspark_ray.protocol.contract import Code, make_entry
from dspark_ray.client import DrafterPool

ap = argparse.ArgumentParser(description="four requests drafting five rounds over several STEP endpoints")
ap.add_argument("endpoints", help="HOST:PORT,HOST:PORT,..., as `dspark-ray serve --pairs N` printed them")
ap.add_argument("--token-file", help="the deployment's token file")
ap.add_argument("--deadline-ms", type=float, default=1000.0, help="each STEP's budget (default %(default)g)")
a = ap.parse_args()
deadline_ms = a.deadline_ms
token = read_token_file(a.token_file) if a.token_file else None
with DrafterPool(a.endpoints, token=token) as pool:
    hello = pool.hello(client="example engine")          # pass model_digest= / config_digest= / tp= to pin them
    width, vocab = hello.limits.taps_width, hello.limits.vocab_size
    rng = np.random.default_rng(0)
    requests = [{"slot": g, "pos": 0, "seed": 1} for g in pool.acquire(4)]
    for rnd in range(5):
        entries = []
        for r in requests:
            rows = 8 if r["pos"] == 0 else 3                 # the prompt tail, then the accepted rows of each round
            taps = rng.standard_normal((rows, width)).astype(np.float16)    # the trunk's tap rows (stream means)
            entries.append(make_entry(slot=r["slot"].slot, generation=r["slot"].generation, seed_token=r["seed"],
                                      start_pos=r["pos"], token_ids=rng.integers(0, vocab, rows), taps=taps,
                                      n_out=5))
            r["rows"] = rows
        for i, (r, res) in enumerate(zip(requests, pool.step(entries, deadline_ms=deadline_ms))):
            if res.code == Code.OK:
                r["seed"], r["pos"] = int(res.drafts_array()[0]), r["pos"] + r["rows"]
                print(f"round {rnd} request {i} on {pool.worker_of(r['slot'].slot)}: drafts "
                      f"{res.drafts_array().tolist()}")
                continue
            print(f"round {rnd} request {i}: {Code(res.code).name} ({res.reason}): verify without drafts")
            if res.code == Code.UNAVAILABLE:                 # its worker is gone: a new slot, the context again
                (r["slot"],) = pool.acquire(1)
                r["pos"] = 0
            elif res.generation != r["slot"].generation:     # resynced: the new generation, the context again
                r["slot"] = type(r["slot"])(slot=r["slot"].slot, generation=res.generation)
                r["pos"] = 0                                 # (a fresh slot may start anywhere)
            # else nothing was applied (a DEADLINE before it ran): the same rows go again next round
    pool.release([r["slot"].slot for r in requests])
