"""Every package the project installs is pinned (constraints.txt), and this environment runs the pinned versions.

A dependency that moves on the registry (triton 3.9.0 did, under the CPU suite) must fail here, in CI, rather than
on a new user's first `bash test.sh`: scripts/env.sh installs with `-c constraints.txt`, and this test checks that
the whole requirement tree of `dspark-ray[test,serve]` is covered by a pin and installed at it.
"""
from __future__ import annotations

import os
import re
from importlib import metadata

import pytest
from packaging.requirements import Requirement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins() -> dict[str, str]:
    pins = {}
    with open(os.path.join(ROOT, "constraints.txt")) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                name, version = line.split("==")
                pins[_norm(name)] = version
    return pins


def _tree(root: str, extras: tuple[str, ...]) -> set[str]:
    """The installed distributions `root[extras]` needs, recursively (markers evaluated here)."""
    seen: set[str] = set()
    todo = [(root, extras)]
    while todo:
        name, ex = todo.pop()
        for spec in metadata.requires(name) or []:
            req = Requirement(spec)
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in (ex or ("",))):
                continue
            key = _norm(req.name)
            if key not in seen:
                seen.add(key)
                todo.append((req.name, tuple(req.extras)))
    return seen


def test_every_requirement_of_the_project_is_pinned_and_installed_at_its_pin():
    pins = _pins()
    gpu_host = os.path.exists(os.path.join(os.environ.get("VIRTUAL_ENV", "") or "", ".gpu-host"))
    host_owned = {"torch"} | ({"triton"} if gpu_host else set())     # scripts/env.sh: the host's CUDA build
    unpinned, moved = [], []
    for name in sorted(_tree("dspark-ray", ("test", "serve")) - host_owned):
        if name not in pins:
            unpinned.append(name)
            continue
        installed = metadata.version(name)
        if installed != pins[name]:
            moved.append(f"{name} {installed} (pinned {pins[name]})")
    assert not unpinned, f"not pinned in constraints.txt: {unpinned}"
    assert not moved, f"installed at another version than constraints.txt: {moved}"


def test_torch_is_the_pinned_cpu_build_on_a_cpu_host():
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU host keeps its own CUDA torch")
    assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
