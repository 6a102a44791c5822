"""What a serving engine embeds: HELLO with the model identity it expects, one slot per live request, one STEP per
decode round. Run against a running endpoint:  python examples/client.py HOST:PORT [DEADLINE_MS]

DEADLINE_MS is each STEP's budget (default 50: a GPU pair answers in about 2 ms; the tiny drafter on a CPU takes
tens of milliseconds a STEP, so give it a second or two there). An answer that is not OK carries the slot's
generation: a new one means the slot was resynced and its context goes in again; the same one means nothing was
applied and the same rows go again.
"""
import sys

import numpy as np

from dspark_ray.client import DrafterClient
from dspark_ray.contract import Code, make_entry

host, port = sys.argv[1].rsplit(":", 1)
deadline_ms = float(sys.argv[2]) if len(sys.argv) > 2 else 50.0
with DrafterClient(host, int(port)) as c:
    hello = c.hello(client="example engine")            # pass model_digest= / config_digest= / tp= to pin them
    width = hello.limits.taps_width
    (slot,) = c.acquire(1)
    rng = np.random.default_rng(0)
    pos, seed, fresh = 0, 1, True
    for rnd in range(5):
        rows = 8 if fresh else 3                          # the prompt tail, then the accepted rows of each round
        taps = rng.standard_normal((rows, width)).astype(np.float16)   # the trunk's tap rows (stream means)
        (res,) = c.step([make_entry(slot=slot.slot, generation=slot.generation, seed_token=seed, start_pos=pos,
                                    token_ids=rng.integers(0, hello.limits.vocab_size, rows), taps=taps, n_out=5)],
                        deadline_ms=deadline_ms)
        if res.code == Code.OK:
            drafts = res.drafts_array()
            print(f"round {rnd}: drafts {drafts.tolist()}, verify the first {res.confident_len}")
            seed, pos, fresh = int(drafts[0]), pos + rows, False
            continue
        print(f"round {rnd}: {Code(res.code).name} ({res.reason}): verify without drafts")
        if res.generation != slot.generation:
            # Resynced (STALE_GENERATION, INTERNAL, a DEADLINE that found its batch on the pair): quote the new
            # generation and re-insert the context (a fresh slot may start anywhere).
            slot, fresh, pos = type(slot)(slot=slot.slot, generation=res.generation), True, 0
    c.release([slot.slot])
