"""What a serving engine embeds: HELLO with the model identity it expects, one slot per live request, one STEP per
decode round. Run against a running endpoint:
    python examples/client.py HOST:PORT --token-file TOKEN_FILE [--deadline-ms MS]

TOKEN_FILE: the deployment's token file, which `serve` and `dspark-ray status` name (leave it out for a deployment
served --insecure). MS is each STEP's budget (default 1000: a GPU pair answers in 1-2 ms, the tiny drafter on a CPU
in 70-150 ms; an engine sets its round's budget, a few ms on GPUs). The trunk here is a stand-in: random taps, and it
accepts the seed and the first draft each round. `RequestSlot` (`c.request()`) sends what the slot lacks; an answer
that is not OK carries no drafts, and the round is verified without them.
"""
import argparse

import numpy as np

from dspark_ray.protocol.access_token import read_token_file
from dspark_ray.client import Code, DrafterClient

ap = argparse.ArgumentParser(description="one request drafting five rounds against a STEP endpoint")
ap.add_argument("endpoint", help="HOST:PORT, as `dspark-ray serve` printed it")
ap.add_argument("--token-file", help="the deployment's token file")
ap.add_argument("--deadline-ms", type=float, default=1000.0, help="each STEP's budget (default %(default)g)")
a = ap.parse_args()
host, port = a.endpoint.rsplit(":", 1)
deadline_ms = a.deadline_ms
token = read_token_file(a.token_file) if a.token_file else None
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
