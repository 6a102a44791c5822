#!/usr/bin/env bash
# Run the test suite (CPU tests; `gpu`-marked tests skip cleanly without CUDA). Sets up .venv on first use.
set -e
source "$(dirname "$0")/scripts/env.sh"
cd "$ROOT"
python -m pytest -q "$@"
