"""The environment of a subprocess that runs the Triton kernels under the interpreter (the CPU tests' stand-in
for the GPU), so TRITON_INTERPRET does not leak into the other tests of the session."""
from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def interpreter_env() -> dict:
    # interpreter_site/sitecustomize.py gives the interpreter's tl.dot a row-independent summation (why: there).
    site = os.path.join(ROOT, "tests", "interpreter_site")
    return dict(os.environ, TRITON_INTERPRET="1",
                PYTHONPATH=os.pathsep.join([site, ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
