#!/usr/bin/env bash
# Join this GPU host to a dspark-ray Ray cluster, its cards as its GPU resources (a pair's placement group asks for
# two {GPU 1, CPU 1} bundles and a {CPU 1} for its front-end), with the environment every dspark-ray actor needs.
#   cluster/start-worker.sh HEAD_IP[:6379]
# A deployment served with --pending places its waiting pairs here as soon as the host has joined. Ray's token must
# be the head's: ~/.ray/auth_token, copied from it (cluster/start-head.sh makes it).
set -euo pipefail
head="${1:?usage: cluster/start-worker.sh HEAD_IP[:PORT]}"
[[ "$head" == *:* ]] || head="$head:6379"
set -a; source "$(dirname "$0")/dspark.env"; set +a
source "$(dirname "$0")/../scripts/env.sh"
# Ray's token authentication (RAY_AUTH_MODE=token in cluster/dspark.env): the head's ~/.ray/auth_token, copied here.
[ -s ~/.ray/auth_token ] || { echo "start-worker.sh: no ~/.ray/auth_token: copy the head's here (0600) first" >&2; exit 1; }
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
exec ray start --address="$head" --num-gpus="$gpus" --disable-usage-stats
