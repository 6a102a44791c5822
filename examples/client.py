"""What a serving engine embeds: HELLO with the model identity it expects, one slot per live request, one STEP per
decode round. Run against a running endpoint:  python examples/client.py HOST:PORT [DEADLINE_MS [TOKEN_FILE]]

DEADLINE_MS is each STEP's budget (default 50: a GPU pair answers in about 2 ms; the tiny drafter on a CPU takes
tens of milliseconds a STEP, so give it a second or two there). The trunk here is a stand-in: random taps, and it
accepts the seed and the first draft each round. `RequestSlot` (`c.request()`) sends what the slot lacks; an answer
that is not OK carries no drafts, and the round is verified without them. TOKEN_FILE: the deployment's token file,
which `serve` and `dspark-ray status` name (none: a deployment served --insecure).
"""
import sys

import numpy as np

from dspark_ray.protocol.access_token import read_token_file
from dspark_ray.client import Code, DrafterClient

host, port = sys.argv[1].rsplit(":", 1)
deadline_ms = float(sys.argv[2]) if len(sys.argv) > 2 else 50.0
token = read_token_file(sys.argv[3]) if len(sys.argv) > 3 else None
rng = np.random.default_rng(0)
with DrafterClient(host, int(port), token=token) as c:
    lim = c.hello(client="example engine").limits       # pass model_digest= / config_digest= / tp= to pin them
    ids = rng.integers(0, lim.vocab_size, 8)              # the prompt's token ids and their tap rows (stream means)
    taps = rng.standard_normal((8, lim.taps_width)).astype(np.float16)
    seed = 1
    with c.request(n_out=5, deadline_ms=deadline_ms) as req:
        for rnd in range(5):
            r = req.step(ids, taps, seed)
            drafts = r.drafts_array()
            if r.code == Code.OK:
                print(f"round {rnd}: drafts {drafts.tolist()}, verify the first {r.confident_len}")
            else:
                print(f"round {rnd}: {Code(r.code).name} ({r.reason}): verify without drafts")
            accepted = [seed, *drafts[:1]]                  # the stand-in trunk keeps the seed and one draft
            ids = np.concatenate([ids, accepted])
            taps = np.concatenate([taps, rng.standard_normal((len(accepted), lim.taps_width)).astype(np.float16)])
            seed = int(rng.integers(0, lim.vocab_size))
