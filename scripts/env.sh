# Create or reuse the project's virtual environment (.venv) and install what it needs. Sourced by run.sh / test.sh.
# CPU hosts get the CPU build of torch pinned to 2.13.0 (an unpinned torch pulls a multi-GB CUDA build); a GPU host
# keeps the torch it already has (its own CUDA build) by creating the venv with --system-site-packages.
set -e
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DSPARK_VENV:-$ROOT/.venv}"
STAMP="$VENV/.dspark-installed"
if [ ! -x "$VENV/bin/python" ]; then
  if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    python3 -m venv --system-site-packages "$VENV"
  else
    python3 -m venv "$VENV"
  fi
fi
# Re-install when pyproject.toml changed since the last install.
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
  echo "[env] installing into $VENV ..." >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    "$VENV/bin/python" -m pip install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
  fi
  "$VENV/bin/python" -m pip install -q -e "$ROOT[test,serve]" 2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/python" -c "import torch, ray, safetensors, msgspec" || { echo "[env] install failed" >&2; exit 1; }
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
