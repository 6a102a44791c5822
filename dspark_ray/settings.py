"""The `DSPARK_*` process-wide knobs in one object, read once from the environment (docs/operations.md, "Knobs").
The front-end hands the same values to every actor it starts, whatever a node's environment says.
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
        """The push kernels' compiled binaries, inside the one cache folder."""
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
        """The environment that makes another process read the same; the cache folder only where it was set, so
        each node keeps its own home's."""
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
    """This process's settings, read on first use and kept."""
    global _current
    if _current is None:
        _current = Settings.from_env()
    return _current


def reread() -> Settings:
    """Read the environment again (tests that change a knob mid-process)."""
    global _current
    _current = None
    return current()
