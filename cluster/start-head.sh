#!/usr/bin/env bash
# Start a Ray head on this GPU host with the environment every dspark-ray actor needs, then deploy one pair.
#   cluster/start-head.sh [--preset full | --checkpoint DIR] [--port 18627]
set -euo pipefail
source "$(dirname "$0")/dspark.env"
source "$(dirname "$0")/../scripts/env.sh"
ray start --head --disable-usage-stats
exec dspark-ray serve --detach "$@"
