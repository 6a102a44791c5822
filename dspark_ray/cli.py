"""dspark-ray: demo | serve | status | stop | endpoints | step | token | synth | layout.

    dspark-ray demo                         the main job on the embedded default: local Ray, tiny drafter pair,
                                            scripted client rounds, shut down
    dspark-ray serve [--detach] ...         deploy one pair on a Ray cluster (joined or embedded); --pairs N for N
    dspark-ray status | stop                inspect or remove a detached deployment (all of its workers)
    dspark-ray endpoints [--address A]      a deployment's current STEP endpoints, read from the cluster's table
    dspark-ray step --endpoint HOST:PORT    the scripted demo client against a running endpoint (or several,
                                            comma-separated: one engine's slots spread over them)
    dspark-ray token [--new PATH]           a deployment's token, read from the cluster; or a new token file
    dspark-ray synth --preset tiny|full --out DIR
    dspark-ray layout --preset tiny|full --tp 1|2 [--json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from .argtypes import NON_NEGATIVE_INT, NON_NEGATIVE_S, PORT, POSITIVE_INT, POSITIVE_S, number
from .transport.tcp import IDLE_TIMEOUT_S, MAX_CONNECTIONS

log = logging.getLogger("dspark_ray")


def _cache_dir() -> Path:
    from .settings import current
    return current().cache_dir


def resolve_checkpoint(preset: str | None, checkpoint: str | None, seed: int = 0, device: str = "cpu") -> str:
    """The checkpoint given, or the preset's synthetic one (made once, then reused)."""
    if checkpoint:
        return checkpoint
    from .config import preset as get_preset
    from .weights.synth import synthesize
    out = _cache_dir() / f"{preset}-seed{seed}"
    if (out / "dspark-manifest.json").exists():
        return str(out)
    print(f"synthesizing the {preset} drafter into {out} ...", flush=True)
    synthesize(get_preset(preset), out, seed=seed, device=device, progress=sys.stderr.isatty())
    print(f"synthesized {out}", flush=True)
    return str(out)


def _gpus() -> int:
    try:
        import torch
        return torch.cuda.device_count()
    except Exception:
        return 0


def connect_ray(address: str | None, detach: bool, start: bool = True) -> str:
    """Join --address / RAY_ADDRESS or the one cluster running on this host, with Ray's token where this process
    holds one (cluster_join.py); else, with `start`, start one (`ray start --head` with --detach, token
    authentication on). ConnectionError saying why it cannot join (several clusters here, none, Ray's token)."""
    import ray
    from .client.cluster_join import cluster_address, token_for_new_cluster, use_ray_token
    from .client.endpoints import Directory
    kw = dict(namespace="dspark", log_to_driver=False, logging_level=logging.WARNING)
    found = cluster_address(address)
    if found is not None:
        use_ray_token()
        Directory(found).check()        # a refusal said in a line now, not after Ray's 20 s of retries
        ray.init(address=found, **kw)
        return f"joined Ray at {found}"
    if not start:
        raise ConnectionError("no Ray cluster runs on this host: name one with --address (or RAY_ADDRESS)")
    if detach:
        made = token_for_new_cluster()
        ray_bin = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
        subprocess.run([ray_bin, "start", "--head", "--disable-usage-stats"], check=True,
                       stdout=subprocess.DEVNULL)
        ray.init(address="auto", **kw)
        return ("started a Ray head (ray start --head, token authentication on" +
                (f"; its token made at {made}" if made else "") + ") and joined it")
    use_ray_token()
    ray.init(include_dashboard=False, **kw)
    return "started an embedded local Ray"


def joined(cmd: str, address: str | None, detach: bool = False, start: bool = True, to=None) -> bool:
    """connect_ray, its line printed (to stdout, or `to`); a refusal printed as `cmd`'s error instead (False)."""
    try:
        print(connect_ray(address, detach, start), file=to or sys.stdout, flush=True)
        return True
    except (ConnectionError, ValueError) as e:
        print(f"dspark-ray {cmd}: {e}", file=sys.stderr)
        return False


def quiet_serve_logs() -> None:
    """Serve's INFO lines repeat what this command says in its own; its warnings still show."""
    logging.getLogger("ray.serve").setLevel(logging.WARNING)


class LoadProgress:
    """The ranks' weight loading: a bar on a terminal, else one line at the start and one at the end."""

    def __init__(self, ranks: int, stream=None):
        self.ranks, self.stream = ranks, stream or sys.stderr
        self.tty = self.stream.isatty()
        self.bar = None
        self.t0 = time.monotonic()
        self.started = self.done = False

    def __call__(self, p) -> None:
        done, total = sum(x[0] for x in p), sum(x[1] for x in p)
        if not total or self.done:
            return
        if not self.started:
            self.started = True
            if self.tty:
                from tqdm import tqdm
                self.bar = tqdm(total=total, desc=f"loading {self.ranks} rank(s)", unit="tensor", leave=False,
                                file=self.stream)
            else:
                print(f"loading the weights on {self.ranks} rank(s) ...", file=self.stream, flush=True)
        if self.bar is not None:
            self.bar.total = max(self.bar.total, total)      # ranks report their totals as they start
            self.bar.n = done
            self.bar.refresh()
        if len(p) == self.ranks and all(n == t > 0 for n, t in p):
            self.close()
            self.done = True
            print(f"weights loaded: {loaded_tensors([t for _, t in p])}, {time.monotonic() - self.t0:.1f} s into "
                  f"the start-up", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def loaded_tensors(per_rank: list[int]) -> str:
    """What the ranks read, in the checkpoint's tensors (as `synth` counts them): each rank reads its cut of every
    tensor it holds, so a sum over ranks would count each tensor once per rank."""
    if len(set(per_rank)) == 1:
        return f"{per_rank[0]} tensors of the checkpoint, each of {len(per_rank)} rank(s) reading its cut"
    return "tensors of the checkpoint read by rank: " + ", ".join(f"{r}: {n}" for r, n in enumerate(per_rank))


SERVE_EXTRA = "pip install -e '.[serve]'"


def missing_serve_extra() -> str | None:
    """Why `--http-port` cannot serve in this environment (Ray Serve's packages, the `serve` extra, not installed),
    or None; asked before Ray is joined, so the refusal is one line and leaves the cluster as it was."""
    try:
        import fastapi  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        return (f"--http-port needs Ray Serve's packages, the `serve` extra ({e.name or e} is not installed): "
                f"{SERVE_EXTRA}")
    return None


class Stop(KeyboardInterrupt):
    """SIGTERM or SIGINT: a KeyboardInterrupt, so no `except Exception` on the way stops the teardown."""


@contextlib.contextmanager
def stopped_by_signals():
    """SIGTERM and SIGINT raise Stop inside, replacing Ray's SIGTERM handler (a `sys.exit` that skips teardown)."""
    def stop(signum, frame):
        raise Stop(signal.Signals(signum).name)
    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def shut_down(name: str, why: str, bound_s: float) -> int:
    """Remove the deployment within `bound_s`, further signals ignored: 0 when gone, 1 when the bound ran out. Where
    the cluster's GCS stops answering meanwhile (a signal to the whole process group stops an embedded Ray, or a
    `ray start --head` in the group, at once), the workers went with it: `cluster_gone` ends the process."""
    import ray
    from .actors.placement import teardown
    from . import http_gateway as http
    from .transport.ring import remove_orphans
    said = []

    def again(signum, frame):
        if not said:
            said.append(1)
            print(f"already stopping (at most {bound_s:g} s)", file=sys.stderr, flush=True)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, again)
    quiet_serve_logs()
    print(f"{why}: stopping {name} ...", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    gcs = ray.get_runtime_context().gcs_address
    step = {"now": "the HTTP app"}

    def run():
        http.stop(name)
        step["now"] = "the workers"
        teardown(name)
        step["now"] = "leftover rings"
        remove_orphans()
        step["now"] = None
    t = threading.Thread(target=run, name="dspark-stop", daemon=True)
    t.start()
    misses = 0
    while step["now"] is not None and time.monotonic() - t0 < bound_s:
        t.join(min(GCS_PROBE_S, max(0.0, bound_s - (time.monotonic() - t0))))
        misses = 0 if step["now"] is None or gcs_answers(gcs) else misses + 1
        if misses >= 2:              # twice, GCS_PROBE_S apart: not a connect lost once
            cluster_gone(name, gcs, t0)
    if step["now"] is not None:
        print(f"dspark-ray {name}: not stopped within {bound_s:g} s (still removing {step['now']})",
              file=sys.stderr, flush=True)
        return 1
    print(f"stopped {name} in {time.monotonic() - t0:.1f} s", flush=True)
    return 0


RINGS_LET_GO_S = 5.0    # how long a teardown whose cluster is gone waits for its front-ends' ring locks to go
GCS_PROBE_S = 0.5       # how often a teardown asks whether the cluster's GCS still takes connections


def gcs_answers(address: str, timeout_s: float = GCS_PROBE_S) -> bool:
    """Whether the GCS at "host:port" takes a connection: a plain connect, since Ray's own calls wait a minute for a
    GCS that is gone."""
    import socket
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def cluster_gone(name: str, gcs: str, t0: float) -> None:
    """The GCS is gone, and the workers with their cluster: remove what they left on this host (their rings and
    doorbells), say so, and exit 0 at once, since Ray's core worker would wait a minute for the GCS, then abort."""
    import re
    from .client.endpoints import worker_pattern
    from .transport.ring import remove_orphans, remove_rings
    ours = re.compile(rf"dspark-{worker_pattern(name).pattern}")
    rings, held = remove_rings(ours, gcs)
    until = time.monotonic() + RINGS_LET_GO_S
    while held and time.monotonic() < until:     # its front-ends are ending with the cluster: their locks go with them
        time.sleep(0.1)
        gone, held = remove_rings(ours, gcs)
        rings += gone
    rings += remove_orphans()
    print(f"the Ray cluster's GCS at {gcs} no longer answers (stopped with this command, or lost): {name}'s "
          f"workers went with it; removed its rings on this host: {', '.join(rings) or 'none left'}"
          + (f"; left {', '.join(held)}: a live process holds them (another cluster's {name}?)" if held else ""),
          file=sys.stderr, flush=True)
    print(f"stopped {name} in {time.monotonic() - t0:.1f} s", flush=True)
    os._exit(0)


def is_loopback(host: str) -> bool:
    import ipaddress
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def kept_token_path(name: str) -> Path:
    """Where `serve` keeps the token it made for the deployment `name` (this host, 0600)."""
    return _cache_dir() / "tokens" / name


def check_token_flags(a) -> None:
    """ValueError, saying how to make a token, for `serve`'s token flags that cannot serve: checked before anything
    starts."""
    from .protocol.access_token import MAKE_ONE
    if a.insecure and a.token_file:
        raise ValueError("--insecure and --token-file: one or the other")
    if not (a.insecure or a.token_file or is_loopback(a.host)):
        raise ValueError(f"--host {a.host} serves beyond this host, to engines that must hold the deployment's "
                         f"token: make one with `{MAKE_ONE}`, give it to them, and serve with --token-file PATH "
                         f"(or --insecure: any peer that reaches the port may draft; docs/operations.md, \"Security\")")


def deployment_token(a) -> tuple[str | None, dict]:
    """(the token every HELLO must carry, where an operator finds it) for `serve`'s flags (check_token_flags); a
    token made here is kept for the next `serve` of the same name, so engines keep theirs. ValueError: a bad file."""
    import socket
    from .protocol.access_token import new_token, read_token_file, readable_by_others, write_token_file
    host = socket.gethostname()
    if a.insecure:
        return None, {"token": False, "insecure": True}
    if a.token_file:
        token = read_token_file(a.token_file)
        loose = readable_by_others(a.token_file)
        if loose:
            print(f"dspark-ray serve: warning: {loose}", file=sys.stderr)
        return token, {"token": True, "token_file": os.path.abspath(a.token_file), "host": host}
    path = kept_token_path(a.name)
    try:
        token = read_token_file(path)
    except ValueError:                       # none yet (or damaged): a new one
        token = new_token()
        write_token_file(path, token)
    return token, {"token": True, "token_file": str(path), "host": host, "made_by_serve": True}


def cmd_serve(a, *, then=None) -> int:
    from .spec import PairSpec
    from .transport.ring import remove_orphans
    try:
        check_token_flags(a)
    except ValueError as e:
        print(f"dspark-ray serve: {e}", file=sys.stderr)
        return 2
    why = missing_serve_extra() if getattr(a, "http_port", None) is not None else None
    if why:
        print(f"dspark-ray serve: {why}", file=sys.stderr)
        return 2
    device = a.device or ("cuda" if _gpus() >= a.tp * a.pairs else "cpu")
    backend = a.backend or ("push" if device == "cuda" and a.tp == 2 else "gloo")
    ckpt = resolve_checkpoint(a.preset, a.checkpoint, device=device)
    try:
        spec = PairSpec(checkpoint=os.path.abspath(ckpt), tp=a.tp, n_slots=a.slots, backend=backend, device=device,
                        collective_timeout_s=a.collective_timeout, rank_cpus=a.rank_cpus,
                        frontend_cpus=a.frontend_cpus, max_batch=a.max_batch, dense=a.dense,
                        markov_cache=a.markov_cache, max_connections=a.max_connections,
                        idle_timeout_s=a.idle_timeout or None, spare_ranks=a.spare_ranks,
                        ring_spin_us=None if a.spin_ms is None else a.spin_ms * 1e3)
    except ValueError as e:
        print(f"dspark-ray serve: {e}", file=sys.stderr)
        return 2
    try:
        token, auth = deployment_token(a)
    except ValueError as e:
        print(f"dspark-ray serve: {e}", file=sys.stderr)
        return 2
    if not joined("serve", a.address, a.detach):
        return 1
    if getattr(a, "http_port", None) is not None:
        from . import http_gateway as http
        try:                     # before placing: a refusal leaves the cluster as it was
            http.check_address(a.host, a.http_port)
        except http.ProxyElsewhere as e:
            print(f"dspark-ray serve: {e}", file=sys.stderr)
            return 2
    gone = remove_orphans()
    if gone:
        print(f"removed {len(gone)} shared-memory ring(s) their dead owners left: {', '.join(gone)}", flush=True)
    with stopped_by_signals():
        try:
            return _serve(a, spec, backend, device, then, token, auth)
        except Stop as e:
            return shut_down(a.name, f"{e.args[0] if e.args else 'SIGINT'} received", a.stop_timeout)


def _serve(a, spec, backend: str, device: str, then, token: str | None, auth: dict) -> int:
    from .actors.placement import deploy_workers
    from .client.endpoints import worker_names
    t0 = time.monotonic()
    progress = LoadProgress(a.tp * a.pairs)
    try:
        workers = deploy_workers(spec, a.pairs, host=a.host, port=a.port, name=a.name, detach=a.detach,
                                 on_progress=progress, pending_ok=getattr(a, "pending", False), token=token,
                                 auth=auth)
    finally:
        progress.close()
    endpoint = ",".join(ep for _, ep in workers if ep)
    waiting = [w for w, (_, ep) in zip(worker_names(a.name, a.pairs), workers) if ep is None]
    if a.pairs == 1:
        print(f"dspark-ray {a.name}: tp {a.tp} ({backend} on {device}) ready in {time.monotonic() - t0:.1f} s; "
              f"STEP endpoint {endpoint}", flush=True)
    else:
        print(f"dspark-ray {a.name}: {a.pairs - len(waiting)} workers of tp {a.tp} ({backend} on {device}) ready in "
              f"{time.monotonic() - t0:.1f} s; STEP endpoints {endpoint} (a DrafterPool spreads slots over them; "
              f"DrafterPool.from_deployment finds them by name)", flush=True)
    if waiting:
        print(f"waiting for room: {', '.join(waiting)} (each starts when a node with room joins the cluster)",
              flush=True)
    print(token_line(auth, a.name), flush=True)
    if getattr(a, "http_port", None) is not None:
        from . import http_gateway as http
        quiet_serve_logs()
        print(f"STEP over HTTP (Ray Serve): {http.start(a.name, endpoint, a.host, a.http_port, token=token)}",
              flush=True)
    if then is not None:
        try:
            rc = then(endpoint, token)
        except Stop:
            raise
        except BaseException:
            shut_down(a.name, "the run failed", a.stop_timeout)
            raise
        return shut_down(a.name, "done", a.stop_timeout) or rc
    if a.detach:
        import ray
        at = f"--name {a.name} --address {ray.get_runtime_context().gcs_address}"
        print(f"detached: `dspark-ray status {at}` / `dspark-ray stop {at}`")
        return 0
    print("serving; Ctrl-C or SIGTERM to stop", flush=True)
    while True:
        time.sleep(3600)


def token_line(auth: dict | None, name: str) -> str:
    """Where the deployment's token is, as `serve`, `status` and `endpoints` say it."""
    if not auth:
        return "token: not recorded"
    if not auth.get("token"):
        return ("token: NONE (served --insecure): whoever reaches an endpoint may HELLO, take slots and draft "
                "(docs/operations.md, \"Security\")")
    where = f"token file {auth['token_file']} on {auth['host']}" if auth.get("token_file") else "token: in the cluster"
    return (f"{where} (every HELLO carries it: DrafterClient(token=...), `dspark-ray step --token-file`; "
            f"DrafterPool.from_deployment and `dspark-ray token --name {name}` read it from the cluster)")


def step_threads(facts: dict | None, prefix: str) -> str:
    """Where the threads named `prefix`* run (scheduling.process_facts), "-" when there is none."""
    from .scheduling import threads_named
    return "; ".join(f"vCPUs {t['allowed']} (last on {t['cpu']}), niceness {t['nice']}"
                     for t in threads_named(facts, prefix)) or "-"


def asleep(w: dict | None) -> str:
    if not w:
        return "no STEPs counted yet"
    return f"{w['after_sleep']} of {w['steps']} STEPs found it asleep (spin {w['spin_ms']:g} ms)"


STATUS_TIMEOUT_S = 2.0      # the survey: the front-ends, all asked at once, answer while the tables are read


@contextlib.contextmanager
def ray_says_it_on_stderr():
    """While inside, stdout (sys.stdout and fd 1) is stderr: Ray's error listener prints what the cluster tells every
    driver ("(raylet) The node ... has been marked dead") to stdout, where it would break `status --json`. The
    command prints its own output after, once Ray is disconnected (ray.shutdown joins that listener)."""
    sys.stdout.flush()
    saved_fd, saved = os.dup(1), sys.stdout
    os.dup2(2, 1)               # Ray's C++ parts write to the fd, its Python parts to sys.stdout
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved_fd, 1)
        os.close(saved_fd)
        sys.stdout = saved


def cmd_status(a) -> int:
    """Every worker: where it runs, whether it serves, its front-end's account (exit codes: docs/operations.md)."""
    import ray
    from .actors.survey import SERVING, survey
    with ray_says_it_on_stderr():
        if not joined("status", a.address, start=False, to=sys.stderr):
            return 1
        t = time.monotonic()
        try:
            rows = survey(a.name, timeout_s=STATUS_TIMEOUT_S)
            auth = _auth_of(a.name)
        finally:
            ray.shutdown()          # sooner than Ray's own hook at exit
        took = time.monotonic() - t
    if rows is None:
        print(f"no deployment named {a.name!r}", file=sys.stderr)
        return 1
    down = [r["worker"] for r in rows if r["state"] != SERVING]
    if a.json:
        print(json.dumps({"name": a.name, "workers": rows, "serving": len(rows) - len(down), "down": down,
                          "auth": auth, "survey_s": round(took, 3)}, indent=1, default=str))
    else:
        print(f"{a.name}: {len(rows)} worker(s), {len(rows) - len(down)} serving"
              + (f", down: {', '.join(down)}" if down else ""))
        print(token_line(auth, a.name))
        for r in rows:
            print(f"{r['worker']}: {r['state'].upper() if r['state'] != SERVING else r['state']}"
                  + (f" ({r['why']})" if r["why"] else "") + f"; {_where(r)}")
            if "status" in r:
                _print_status(r["status"])
    return 3 if down else 0


def _where(r: dict) -> str:
    node = (f"node {r['node_id'][:8]} ({r['node_ip']}{', dead' if r['node_alive'] is False else ''})"
            if r["node_id"] else "no node yet")
    cards = [str(c) for rank in r["cards"] or [] for c in rank]
    cards = f"cards {','.join(cards)}" if cards else ("CPU ranks" if r["cards"] else "cards ?")
    return f"{node}, {cards}, endpoint {r['endpoint'] or '-'}"


def _print_status(st: dict) -> None:
    print(f"  {st['name']}: endpoint {st['endpoint']}, tp {st['tp']} ({st['backend']}), worker generation "
          f"{st['worker_generation']}, {'UNAVAILABLE: ' + st['unavailable'] if st['unavailable'] else 'serving'}")
    print(f"  slots {st['slots']['held']}/{st['slots']['capacity']} held, {st['sessions']} sessions; "
          f"steps {st['stats']['steps']}, batches {st['stats']['batches']} (up to {st.get('max_batch')} entries "
          f"each), entries {st['stats']['entries']}")
    print(f"  supervisor: {supervisor_words(st['supervisor'])}")
    if st.get("spares"):
        print(f"  spare ranks: {st.get('spares_ready', 0)} of {st['spares']} sets ready (a restart takes one)")
    if st.get("settings"):
        print("  settings: " + ", ".join(f"{k}={v}" for k, v in st["settings"].items()))
    print(f"  endpoint threads: {step_threads(st.get('process'), 'tcp-')}; {asleep(st.get('wake_ups'))}")
    for r in st["ranks"]:
        loop = step_threads(r.get("process"), f"dspark-rank{r.get('rank')}")
        print(f"  rank {r.get('rank')}: pid {r.get('pid')}, steps {r.get('steps')}, failed {r.get('failed_steps')},"
              f" broken {r.get('broken')}, last error {r.get('last_error') or '-'}; step loop: {loop}; "
              f"{asleep(r.get('wake_ups'))}; {_matmul(r.get('matmul'))}; {_markov_cache(r.get('markov_cache'))}")
    for e in st["last_errors"]:
        print(f"  error: {e}")


def supervisor_words(sv: dict | None) -> str:
    """The supervisor's account (supervisor.py's status) in a line of words; keys it does not know are left out."""
    if not isinstance(sv, dict):
        return "?"
    words = ["restarting now" if sv.get("restarting") else "not restarting"]
    if "restarts" in sv:
        took = sv.get("restart_seconds") or []
        words.append(f"{sv['restarts']} restart(s) so far" +
                     (f" (took {', '.join(f'{t:.1f}' for t in took)} s)" if took else ""))
    if "consecutive_failures" in sv:
        words.append(f"{sv['consecutive_failures']} failed step(s) in a row"
                     + (f" (a restart at {sv['threshold']})" if "threshold" in sv else ""))
    last = sv.get("last_restart") or {}
    if last:
        seen, back = last.get("failure_seen"), last.get("serving")
        words.append(f"the last for {last.get('why') or '?'}: {len(last.get('attempts') or [])} attempt(s), "
                     + (f"serving again {back - seen:.1f} s after the failure" if seen and back else "not serving yet"))
    return "; ".join(words)


def _markov_cache(m: dict | None) -> str:
    if not m:
        return "markov cache ?"
    return f"markov cache {m['rows']} rows ({m['bytes'] / 2**30:.2f} GiB)" if m["rows"] else "markov cache off"


def _matmul(m: dict | None) -> str:
    if not m:
        return "matmul ?"
    return f"matmul {m['mode']}" + (f" (dense {m['dense']})" if m.get("dense") else "")


def _auth_of(name: str) -> dict | None:
    """The deployment record's account of its token (placement.deploy_workers), from the joined cluster."""
    import ray
    from .client.endpoints import Directory
    try:
        return (Directory(ray.get_runtime_context().gcs_address).deployment(name) or {}).get("auth")
    except ConnectionError:
        return None


def cmd_endpoints(a) -> int:
    """The deployment's STEP endpoints from the endpoint table (only the GCS is asked, no Ray driver): `-` / null for
    a worker that serves nowhere now, a stale entry (its owner gone) named on stderr with why; where its token is, on
    stderr. Exit 3 when a worker does not serve."""
    from .client.endpoints import Directory, live_endpoints
    try:
        directory = Directory(a.address)
        entries = directory.entries(a.name)
        auth = (directory.deployment(a.name) or {}).get("auth")
    except (LookupError, ConnectionError, ValueError) as e:
        print(f"dspark-ray endpoints: {e}", file=sys.stderr)
        return 1
    eps = live_endpoints(entries)
    print(json.dumps(eps) if a.json else ",".join(ep or "-" for ep in eps.values()))
    for w, e in entries.items():
        if not e["live"]:
            said = f"stale entry {e['endpoint']}" if e["stale"] else "not serving"
            print(f"{w}: {said}: {e['why']}", file=sys.stderr)
    print(token_line(auth, a.name), file=sys.stderr)
    return 0 if all(eps.values()) else 3


def cmd_token(a) -> int:
    """`--new PATH`: a new token file (0600). Else the deployment's token, read from the cluster's GCS."""
    from .protocol.access_token import new_token, write_token_file
    from .client.endpoints import Directory
    if a.new:
        write_token_file(a.new, new_token())
        print(f"a new token in {a.new} (0600): serve with --token-file {a.new}; engines send its contents")
        return 0
    try:
        token = Directory(a.address).token(a.name)
    except (ConnectionError, ValueError) as e:
        print(f"dspark-ray token: {e}", file=sys.stderr)
        return 1
    if token is None:
        print(f"dspark-ray token: no token for {a.name!r} in the cluster (no such deployment, or one served "
              f"--insecure)", file=sys.stderr)
        return 1
    print(token)
    return 0


def cmd_stop(a) -> int:
    """Remove the deployment, saying what was removed of each worker; exit 1 when there was nothing to remove."""
    from .actors.placement import teardown
    from . import http_gateway as http
    from .transport.ring import remove_orphans
    if not joined("stop", a.address, start=False, to=sys.stderr):
        return 1
    quiet_serve_logs()
    had_http = http.stop(a.name)
    removed = teardown(a.name)
    gone = remove_orphans()
    if gone:
        print(f"removed {len(gone)} shared-memory ring(s) their dead owners left: {', '.join(gone)}",
              file=sys.stderr)
    if not (had_http or removed):
        print(f"no deployment named {a.name!r}", file=sys.stderr)
        return 1
    if had_http:
        print(f"stopped {a.name}-http (its HTTP app)")
    for w, parts in removed.items():
        print(f"stopped {w}: {removed_words(parts)}")
    return 0


def removed_words(parts: list[str]) -> str:
    """What `teardown` removed of one worker, in a line: "removed its front-end, placement group and endpoint entry";
    a worker without its front-end any more is said to have had none to stop."""
    said = parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"
    gone = "" if "front-end" in parts else " (its front-end was gone already)"
    return f"removed its {said}{gone}"


def cmd_step(a) -> int:
    from .protocol.access_token import read_token_file
    from .client.drafter_client import ClientError
    from .client.demo import run
    try:
        token = read_token_file(a.token_file) if a.token_file else None
    except ValueError as e:
        print(f"dspark-ray step: {e}", file=sys.stderr)
        return 2
    try:
        run(a.endpoint, rounds=a.rounds, requests=a.requests, seed=a.seed, shm=a.shm, token=token)
    except ClientError as e:
        print(f"dspark-ray step: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_demo(a) -> int:
    from .client.demo import run
    return cmd_serve(a, then=lambda ep, token: (run(ep, rounds=a.rounds, requests=a.requests, token=token), 0)[1])


def cmd_layout(a) -> int:
    from .config import preset
    from .model.layout import memory_table
    from .weights.inventory import tensor_specs
    cfg = preset(a.preset)
    specs = {n: (s.shape, s.dtype.itemsize) for n, s in tensor_specs(cfg).items()}
    rows = memory_table(cfg, a.tp, specs)
    if a.json:
        print(json.dumps({"preset": a.preset, "tp": a.tp, "rows": rows}, indent=1))
        return 0
    mib = 2 ** 20
    print(f"{a.preset} preset, tp {a.tp}: what each rank holds (MiB, compute form)")
    print(f"{'item':28s}" + "".join(f"{'rank ' + str(r):>12s}" for r in range(a.tp)) + "  cut")
    for r in rows:
        print(f"{r['item']:28s}" + "".join(f"{b / mib:12.1f}" for b in r["bytes"]) + f"  {r['cut']}")
    tot = [sum(r["bytes"][k] for r in rows) for k in range(a.tp)]
    print(f"{'total':28s}" + "".join(f"{b / mib:12.1f}" for b in tot))
    return 0


def cpu_list(text: str) -> list[int]:
    return [int(c) for c in text.split(",") if c.strip()]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["synth"]:
        from .weights.synth_command import synth_main
        return synth_main(argv[1:])
    a = parser().parse_args(argv)
    return a.fn(a)


def parser() -> argparse.ArgumentParser:
    """Every command's arguments but synth's (weights/synth.py's own parser)."""
    p = argparse.ArgumentParser(prog="dspark-ray", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def serve_args(sp):
        sp.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, a running local one, or embedded)")
        g = sp.add_mutually_exclusive_group()
        g.add_argument("--preset", choices=["tiny", "full"], default="tiny")
        g.add_argument("--checkpoint", help="a checkpoint directory in the DeepSeek-V4 namespace")
        sp.add_argument("--tp", type=int, choices=[1, 2], default=2)
        sp.add_argument("--pairs", type=POSITIVE_INT, default=1,
                        help="workers to place side by side (pairs at --tp 2, one card each at --tp 1), each with "
                             "its own STEP endpoint; a client spreads its slots over them (pool.DrafterPool)")
        sp.add_argument("--host", default="127.0.0.1",
                        help="the STEP endpoints' interface (0.0.0.0: every interface, each endpoint then names its "
                             "worker's node IP, for clients on other hosts of a multi-node cluster)")
        sp.add_argument("--port", type=PORT, default=0, help="the STEP port (0: a free one; with --pairs N: "
                                                             "PORT, PORT+1, ...)")
        sp.add_argument("--slots", type=POSITIVE_INT, default=16, help="slots (live requests) a worker holds")
        sp.add_argument("--max-batch", type=POSITIVE_INT, default=16,
                        help="entries one replay takes (at most --slots): a wider STEP runs in several batches; each "
                             "bucket above 4 requests is one more captured graph pair per margins setting")
        sp.add_argument("--dense", choices=["auto", "triton", "cublas"], default="auto",
                        help="the dense linears' kernel on a GPU: auto picks the one-read Triton kernel when a batch "
                             "can span more than 32 rows (--max-batch 7 or more), cuBLAS otherwise (2-7%% faster "
                             "at 1 request, 9-17%% slower at 8-16)")
        sp.add_argument("--markov-cache", default="auto",
                        help="cached Markov bias rows (the same drafts, less read per step): auto (every token's "
                             "row on a GPU when they take at most half the memory the weights leave: 15.6 GiB a "
                             "pair rank of the full preset), all, off, or a row count (the lower ids)")
        sp.add_argument("--name", default="dspark")
        sp.add_argument("--device", choices=["cpu", "cuda"])
        # No choices=: comm.factory would cost `status` torch's import; PairSpec checks it.
        sp.add_argument("--backend", help="the pair's collectives: gloo (CPU) or push (NVLink)")
        sp.add_argument("--collective-timeout", type=POSITIVE_S, default=10.0,
                        help="seconds a rank's collective waits for its peer before the step fails closed")
        sp.add_argument("--rank-cpus", type=cpu_list, help="vCPUs for the ranks' step loops, one per rank: 9,12")
        sp.add_argument("--frontend-cpus", type=cpu_list, help="vCPUs for the front-end's endpoint threads")
        sp.add_argument("--max-connections", type=POSITIVE_INT, default=MAX_CONNECTIONS,
                        help="connections a STEP endpoint holds at once (one thread each); one more is refused with "
                             "an OVERLOADED frame")
        sp.add_argument("--idle-timeout", type=NON_NEGATIVE_S, default=IDLE_TIMEOUT_S,
                        help="seconds a session may go without a request before it is closed and its slots freed "
                             "(0: never)")
        sp.add_argument("--spare-ranks", type=number(int, 0, 4),
                        help="spare rank processes kept per rank, started ahead so a restart skips the process "
                             "start, the imports and the CUDA context, and on a GPU reads the weights from the "
                             "checkpoint's pages the spares keep pinned (default 2 on a GPU, 0 on a CPU; each costs a "
                             "process with torch loaded and, on a GPU, a CUDA context)")
        sp.add_argument("--spin-ms", type=NON_NEGATIVE_S,
                        help="how long the ranks and the front-end poll for the next STEP before they sleep "
                             "(default 100 on a GPU host: longer than a trunk's forward; 0.05 on a CPU)")
        sp.add_argument("--token-file", help="the file holding the deployment's token, which every HELLO must carry "
                                             "(`dspark-ray token --new PATH` makes one); without it, on a loopback "
                                             "--host, serve makes one and keeps it in the cache folder")
        sp.add_argument("--insecure", action="store_true",
                        help="no token: any peer that reaches an endpoint may HELLO, take slots and draft")

    sp = sub.add_parser("serve", help="deploy one pair (or --pairs N) and serve STEP")
    serve_args(sp)
    sp.add_argument("--http-port", type=number(int, 1, 65535),
                    help="also serve STEP as JSON over HTTP through Ray Serve on this port (milliseconds a call: the "
                         "convenience path; the `serve` extra: pip install -e '.[serve]')")
    sp.add_argument("--detach", action="store_true", help="leave detached actors behind (starts `ray start --head` "
                                                          "when no cluster runs)")
    sp.add_argument("--pending", action="store_true",
                    help="a worker that finds no room waits for it (Ray places it when a node with room joins, e.g. "
                         "one the autoscaler adds) instead of failing the deployment")
    sp.set_defaults(fn=cmd_serve)
    sp.add_argument("--stop-timeout", type=POSITIVE_S, default=60.0,
                    help="on SIGTERM or SIGINT: the longest the teardown may take (seconds) before serve gives up "
                         "and exits 1")
    sp = sub.add_parser("demo", help="the main job on the embedded default: serve, run the demo client, stop")
    serve_args(sp)
    sp.add_argument("--rounds", type=POSITIVE_INT, default=8)
    sp.add_argument("--requests", type=POSITIVE_INT, default=2)
    sp.set_defaults(fn=cmd_demo, detach=False, stop_timeout=60.0)
    for name, fn, what in (
            ("status", cmd_status, "each worker of a deployment: where it runs, whether it serves, its front-end's "
                                   "account (--json: the same as JSON)"),
            ("stop", cmd_stop, "remove a deployment: every worker, its HTTP app, its placement groups"),
            ("endpoints", cmd_endpoints, "a deployment's STEP endpoints, read from the cluster's table")):
        sp = sub.add_parser(name, help=what, description=what)
        sp.add_argument("--address")
        sp.add_argument("--name", default="dspark")
        sp.add_argument("--json", action="store_true")
        sp.set_defaults(fn=fn)
    sp = sub.add_parser("step", help="the scripted demo client against a running endpoint")
    sp.add_argument("--endpoint", required=True, help="HOST:PORT, or several comma-separated (a DrafterPool)")
    sp.add_argument("--rounds", type=POSITIVE_INT, default=8)
    sp.add_argument("--requests", type=POSITIVE_INT, default=2)
    sp.add_argument("--seed", type=NON_NEGATIVE_INT, default=0)
    sp.add_argument("--shm", action="store_true", help="requests through shared memory (the endpoint's host only)")
    sp.add_argument("--token-file", help="the deployment's token (`dspark-ray status` says where it is)")
    sp.set_defaults(fn=cmd_step)
    sp = sub.add_parser("token", help="print a deployment's token (read from the cluster), or make a token file")
    sp.add_argument("--address")
    sp.add_argument("--name", default="dspark")
    sp.add_argument("--new", metavar="PATH", help="write a new token to PATH (0600) and print nothing of it")
    sp.set_defaults(fn=cmd_token)
    # synth's own parser is weights/synth_command.py's (it imports torch): main() hands it its arguments first.
    sub.add_parser("synth", help="write a deterministic synthetic checkpoint (dspark-ray synth --help)")
    sp = sub.add_parser("layout", help="what each rank holds, from the layout table")
    sp.add_argument("--preset", choices=["tiny", "full"], default="full")
    sp.add_argument("--tp", type=int, choices=[1, 2], default=2)
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_layout)
    return p


if __name__ == "__main__":
    sys.exit(main())
