#!/usr/bin/env bash
# The GPU checks and the committed GPU figures in one command, on a GPU host: one card, or a pair when two cards
# are visible. Synthesizes the full preset if CKPT does not hold one yet, runs the `gpu` tests (bit identity:
# graph == eager, every batch bucket == the one-request answer, the pair == the emulated pair), then the draft-step,
# STEP-latency, restart (one card) and (pair only) scaling benches. Each step prints one line with its exit code and
# the elapsed time; its output goes to OUT.
#
#     bash scripts/gpu_checks.sh [OUT] [CKPT]          (defaults: gpu-checks/, /tmp/full)
#
# ONLY=name,name runs only those steps (the names the lines print; the device machine's calls last 10 minutes).
# PIN_CPUS=a,b: the vCPUs the draft-step bench pins its rank processes to (tp1 and solo take the first), as the
# committed tables were measured (default 5,2 on hosts of 6+ vCPUs; empty: unpinned).
# On the project's device machine: `source .devbundle/setup.sh` first (Ray and msgspec), and give $OUT as OUT.
set -u
OUT=${1:-gpu-checks}
CKPT=${2:-/tmp/full}
mkdir -p "$OUT"
# No NVLink multicast objects: NCCL's NVLS, torch's symmetric memory and NVSHMEM would each create them.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
export CUDA_MODULE_LOADING=${CUDA_MODULE_LOADING:-EAGER} PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
T0=$(date +%s)
CARDS=$($PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$CARDS" -lt 1 ]; then
    echo "gpu_checks: no CUDA device visible" >&2
    exit 2
fi
FAILED=0
if [ -z "${PIN_CPUS+x}" ]; then
    PIN_CPUS=$([ "$(nproc)" -ge 6 ] && echo 5,2 || echo "")
fi

step() {  # name limit_s command...: run one step, its output to OUT/name.txt
    local name=$1 limit=$2
    shift 2
    if [ -n "${ONLY:-}" ] && [[ ",$ONLY," != *",$name,"* ]]; then
        return 0
    fi
    echo "[gpu_checks] $name: started ($(( $(date +%s) - T0 )) s)"
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    [ $rc -eq 0 ] || FAILED=1
    echo "[gpu_checks] $name: rc $rc ($(( $(date +%s) - T0 )) s): $(tail -n 1 "$OUT/$name.txt")"
}

if [ ! -f "$CKPT/dspark-manifest.json" ]; then        # written last: a checkpoint synthesized to the end
    step synthesize 600 $PY -c "from dspark_ray.weights.synth import synthesize; from dspark_ray.config import full; \
synthesize(full(), '$CKPT', device='cuda:0', progress=False); print('full preset synthesized to $CKPT')"
fi
step tests_one_card 900 $PY -m pytest -q -rA tests/test_chunked_linear.py tests/test_gemm.py tests/test_fused.py \
    tests/test_gpu_graphs.py tests/test_gpu_drafter.py tests/test_markov_cache.py tests/test_push_gpu.py -m gpu
DSPARK_TEST_CKPT=$CKPT step tests_full_graph_set 600 $PY -m pytest -q tests/test_gpu_graphs.py \
    tests/test_markov_cache.py -m gpu -k "(every_graph_of_the_set or wide_buckets) and fast or live_bits_on_the_card"
if [ "$CARDS" -ge 2 ]; then
    DSPARK_FULL_CKPT=$CKPT step tests_push_pair 900 $PY -m pytest -q -rA tests/test_push_pair.py
    DSPARK_TEST_PAIR=push step tests_deployed_pair 900 $PY -m pytest -q -rA tests/test_deploy.py \
        tests/test_keep_warm.py tests/test_supervision.py -k "not http"
    MODES=tp1,pair,solo TP=2
else
    MODES=tp1,solo TP=1
fi
# from position 900,000 (the committed tables' start: the RoPE angles of a 1M-token context)
step draft_step 900 $PY bench/draft_step.py --ckpt "$CKPT" --modes $MODES --replays 300 --start 900000 \
    ${PIN_CPUS:+--pin-cpus "$PIN_CPUS"} --out "$OUT/draft_step.json" --md "$OUT/draft_step.md"
step step_latency 600 $PY bench/step_latency.py --tp $TP --preset full --ckpt "$CKPT" --rounds 2000 \
    --out "$OUT/step_latency.json"
# kill -9 of the rank of a one-card worker mid-load, five times, then twice with a second kill of the restarting rank:
# time to serving again by phase (target <= 8 s p50; a kill during a restart within twice that), and every OK answer
# against a fresh deployment's bits
step restart 900 $PY bench/restart.py --preset full --checkpoint "$CKPT" --tp 1 --device cuda --rounds 100 \
    --kills 5 --kills-during-restart 2 --out "$OUT/restart.json"
# EXL3 (needs exllamav3: make-bundle.sh --exl3): the kernel table for this card kind (written into the tree: commit
# it), the EXL3 gpu tests, parity with exllamav3's own drafter (tiny, then full with its step timed), and the draft
# step on seed 000's EXL3 mix beside the bf16 one. Checkpoints go to EXL3_ROOT (bench/parity_exl3.py --root).
EXL3_ROOT=${EXL3_ROOT:-/tmp/parity_exl3}
step exl3_table 600 bash -c "$PY -c \"import sys; sys.path.insert(0, 'bench'); from pathlib import Path; \
from parity_exl3 import ensure; [ensure(p, 'exl3', Path('$EXL3_ROOT')) for p in ('tiny', 'full')]\" && \
$PY tools/exl3_kernel_table.py --ckpt $EXL3_ROOT/full_exl3 --ckpt $EXL3_ROOT/tiny_exl3 && cp dspark_ray/kernels/exl3_shapes.json $OUT/"
step tests_exl3 600 $PY -m pytest -q -rA -s tests/test_exl3_gpu.py
step parity_exl3_tiny 600 $PY bench/parity_exl3.py --preset tiny --seeds 0,1,2,3,4,5,6,7 --root "$EXL3_ROOT" \
    --out "$OUT/parity_exl3_tiny.json"
step parity_exl3_full 900 $PY bench/parity_exl3.py --preset full --seeds 0,1,2,3,4,5,6,7 --time 1,4 \
    --root "$EXL3_ROOT" --out "$OUT/parity_exl3_full.json"
# four requests a round in lockstep: exllamav3's multi-request path, the expert kernel our rank runs
step parity_exl3_batch4 900 $PY bench/parity_exl3.py --preset full --seeds $(seq -s, 0 15) --batch 4 \
    --root "$EXL3_ROOT" --out "$OUT/parity_exl3_full_batch4.json"
for f in exl3 bf16; do
    step draft_step_$f 900 $PY bench/draft_step.py --ckpt "$EXL3_ROOT/full_$f" --modes tp1,solo --shapes "1,5 4,5" \
        --replays 300 --start 900000 --markov-cache off ${PIN_CPUS:+--pin-cpus "$PIN_CPUS"} \
        --out "$OUT/draft_step_$f.json" --md "$OUT/draft_step_$f.md"
done
if [ "$CARDS" -ge 2 ]; then
    step scaling 900 $PY bench/scaling.py --preset full --ckpt "$CKPT" --cards 2 --requests 1,2,4,8,12,16 \
        --rounds 300 --warmup-rounds 300 --slots 16 --out "$OUT/scaling.json"
fi
echo "[gpu_checks] done in $(( $(date +%s) - T0 )) s: $([ $FAILED -eq 0 ] && echo all passed || echo some failed)"
exit $FAILED
