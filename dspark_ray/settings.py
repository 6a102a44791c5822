"""Every process-wide knob of dspark-ray in one object, read once from the environment.

A deployment is described by `PairSpec` and the `serve` flags; what is left are the few switches below, each a
`DSPARK_*` environment variable. `current()` reads them the first time it is asked and keeps them; the front-end
logs them at start-up, hands the same values to every actor it starts (`as_env`, into the actors' runtime_env, so a
`ray start` cluster's workers see the driver's choice), and `dspark-ray status` shows them.

| variable                      | default                  | what                                                          |
|-------------------------------|--------------------------|---------------------------------------------------------------|
| `DSPARK_CACHE`                | `~/.cache/dspark-ray`    | synthetic preset checkpoints, and the compiled push kernels (`kernels/` inside) |
| `DSPARK_KEEP_WARM`            | `1`                      | `0`: the parties do not rehearse their step path between steps (`keep_warm.py`) |
| `DSPARK_KEEP_WARM_US`         | `100`                    | the rehearsal period while a party waits                       |
| `DSPARK_KEEP_WARM_HOLD_US`    | `250`                    | the first rehearsal after a real step waits this long          |
| `DSPARK_KEEP_WARM_LAUNCH_US`  | `1000`                   | a GPU rank rehearses a graph launch this often; `0`: never     |
| `DSPARK_STEP_GRAPHS`          | `1`                      | `0`: no step graphs (insert and draft as separate replays; the same bits) |
| `DSPARK_PDL`                  | `1`                      | `0`: the fused kernels launch without programmatic dependent launch |
| `DSPARK_PUSH_TIMEOUT_MS`      | the push backend's 2000  | how long a push collective waits for its peer before failing closed |
| `DSPARK_STAMP_CPU`            | `0`                      | `1`: the parties also stamp each hop's thread CPU time (the latency bench) |
"""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Mapping

log = logging.getLogger("dspark_ray.settings")


def _flag(v: str) -> bool:
    if v not in ("0", "1"):
        raise ValueError(f"{v!r}: 0 or 1")
    return v == "1"


def _us(v: str) -> float:
    x = float(v)
    if not x >= 0:
        raise ValueError(f"{v!r}: a duration of 0 or more")
    return x


@dataclass(frozen=True)
class Settings:
    cache_dir: Path = Path.home() / ".cache" / "dspark-ray"
    keep_warm: bool = True
    keep_warm_us: float = 100.0
    keep_warm_hold_us: float = 250.0
    keep_warm_launch_us: float = 1000.0
    step_graphs: bool = True
    pdl: bool = True
    push_timeout_ms: float | None = None
    stamp_cpu: bool = False

    @property
    def kernel_cache(self) -> Path:
        """Where the push kernels' compiled binaries are kept (inside the one cache folder)."""
        return self.cache_dir / "kernels"

    @staticmethod
    def from_env(env: Mapping[str, str] = os.environ) -> "Settings":
        """The knobs `env` sets; a malformed value raises, naming its variable."""
        got = {}
        for f in fields(Settings):
            var, parse = _VARS[f.name]
            if var in env:
                try:
                    got[f.name] = parse(env[var])
                except ValueError as e:
                    raise ValueError(f"{var}={env[var]!r}: {e}") from None
        return Settings(**got)

    def as_env(self) -> dict[str, str]:
        """These settings as the environment that makes another process read the same: every knob spelt out, but
        the cache folder only where it was set (left alone, each node keeps its own home's)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None or (f.name == "cache_dir" and v == f.default):
                continue
            out[_VARS[f.name][0]] = ("1" if v else "0") if isinstance(v, bool) else str(v)
        return out

    def describe(self) -> str:
        """One line for the start-up log: the knobs that differ from their defaults."""
        changed = [f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                   if getattr(self, f.name) != f.default]
        return "settings: " + (", ".join(changed) if changed else "defaults") + f" (cache {self.cache_dir})"

    def to_dict(self) -> dict:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(self).items()}


_VARS = {
    "cache_dir": ("DSPARK_CACHE", lambda v: Path(v).expanduser()),
    "keep_warm": ("DSPARK_KEEP_WARM", _flag),
    "keep_warm_us": ("DSPARK_KEEP_WARM_US", _us),
    "keep_warm_hold_us": ("DSPARK_KEEP_WARM_HOLD_US", _us),
    "keep_warm_launch_us": ("DSPARK_KEEP_WARM_LAUNCH_US", _us),
    "step_graphs": ("DSPARK_STEP_GRAPHS", _flag),
    "pdl": ("DSPARK_PDL", _flag),
    "push_timeout_ms": ("DSPARK_PUSH_TIMEOUT_MS", _us),
    "stamp_cpu": ("DSPARK_STAMP_CPU", _flag),
}

_current: Settings | None = None


def current() -> Settings:
    """This process's settings, read from its environment on first use and kept."""
    global _current
    if _current is None:
        _current = Settings.from_env()
    return _current


def reread() -> Settings:
    """Read the environment again (tests that change a knob between two parts of one process)."""
    global _current
    _current = None
    return current()
