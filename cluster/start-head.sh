#!/usr/bin/env bash
# Start a Ray head on this GPU host with the environment every dspark-ray actor needs, then deploy one pair.
#   cluster/start-head.sh [--preset full | --checkpoint DIR] [--port 18627] [--host 0.0.0.0]
# Two tokens, made here once if missing (docs/operations.md, "Security"): Ray's, in ~/.ray/auth_token (token
# authentication, RAY_AUTH_MODE=token in cluster/dspark.env; copy the file to every worker host), and the
# deployment's, in $DSPARK_TOKEN_FILE (default ~/.dspark-ray/step-token), which every engine's HELLO carries.
set -euo pipefail
source "$(dirname "$0")/dspark.env"
source "$(dirname "$0")/../scripts/env.sh"
[ -s ~/.ray/auth_token ] || ray get-auth-token --generate >/dev/null
chmod 600 ~/.ray/auth_token
token="${DSPARK_TOKEN_FILE:-$HOME/.dspark-ray/step-token}"
[ -s "$token" ] || dspark-ray token --new "$token" >/dev/null
ray start --head --disable-usage-stats
exec dspark-ray serve --detach --token-file "$token" "$@"
