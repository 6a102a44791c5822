# Create or reuse the project's virtual environment (.venv) and install what it needs. Sourced by run.sh / test.sh.
# CPU hosts get the CPU build of torch pinned to 2.13.0 (an unpinned torch pulls a multi-GB CUDA build); a GPU host
# keeps the torch it already has (its own CUDA build) by creating the venv with --system-site-packages. Every other
# package is pinned by constraints.txt, so a fresh clone gets the versions the suite passed with, not today's.
# Sourced into an interactive shell it must leave that shell's options as they were (a `set -e` left on would close
# the terminal at the next failing command): the set-up runs under `set -e` in a subshell, the exports after it.
_dspark_env_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
(
set -e
ROOT="$_dspark_env_root"
VENV="${DSPARK_VENV:-$ROOT/.venv}"
STAMP="$VENV/.dspark-installed"
CONSTRAINTS="$ROOT/constraints.txt"
if [ ! -x "$VENV/bin/python" ]; then
  if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    python3 -m venv --system-site-packages "$VENV"
    touch "$VENV/.gpu-host"
  else
    python3 -m venv "$VENV"
  fi
fi
if [ -f "$VENV/.gpu-host" ]; then       # the host's CUDA torch brought its own triton: keep that one
  grep -v "^triton==" "$ROOT/constraints.txt" > "$VENV/constraints-gpu.txt"
  CONSTRAINTS="$VENV/constraints-gpu.txt"
fi
# Re-install when pyproject.toml or the pins changed since the last install.
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ] || [ "$ROOT/constraints.txt" -nt "$STAMP" ]; then
  echo "[env] installing into $VENV ..." >&2
  pip_install() {      # pip's own failure fails the set-up (the filter only hides a registry warning)
    "$VENV/bin/python" -m pip install -q "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }
    [ "${PIPESTATUS[0]}" = 0 ] || { echo "[env] pip install $* failed" >&2; exit 1; }
  }
  pip_install -c "$CONSTRAINTS" pip
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    pip_install "torch==2.13.0"
  fi
  pip_install -c "$CONSTRAINTS" -e "$ROOT[test,serve]"
  "$VENV/bin/python" -c "import torch, ray, safetensors, msgspec" || { echo "[env] install failed" >&2; exit 1; }
  touch "$STAMP"
fi
) || { _dspark_env_rc=$?; unset _dspark_env_root; return $_dspark_env_rc 2>/dev/null || exit $_dspark_env_rc; }
ROOT="$_dspark_env_root"
VENV="${DSPARK_VENV:-$ROOT/.venv}"
unset _dspark_env_root
export PATH="$VENV/bin:$PATH"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
