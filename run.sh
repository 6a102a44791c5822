#!/usr/bin/env bash
# The main job on the embedded default: synthesize the tiny drafter and draft with it. Sets up .venv on first use.
set -e
source "$(dirname "$0")/scripts/env.sh"
cd "$ROOT"
exec dspark-ray demo "$@"
