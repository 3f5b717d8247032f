#!/usr/bin/env bash
# The embedded target v2's training run on one GPU machine (issue 35): at most 8 minutes.
#
# Here, first:  python bench/gpu_train.py pack --corpus DIR   (DIR from `leapdecode train corpus`)
# There:        the device tool's run, carrying .gpu:  bash bench/gpu_train.sh
# Rehearsal:    TINY=1 OUT=/tmp/gpu-out bash bench/gpu_train.sh   (CPU, toy sizes, seconds)
#
# Writes into $OUT (the device's output folder) at most 8 files of at most 16 MiB: the
# weights (sharded safetensors, bfloat16), their index, config.json, log.jsonl, summary.json.
# Extra arguments go to `bench/gpu_train.py run`.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:?set OUT to the output folder}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -n "${TINY:-}" ]; then
    exec python3 bench/gpu_train.py run --out "$out" --tiny --device cpu --minutes "${MINUTES:-0.5}" \
        --context 64 --batch 4 --sweep-seconds 2 --eval-seconds 5 --copy-spans 4 --no-compile "$@"
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
exec python3 bench/gpu_train.py run --out "$out" --minutes "${MINUTES:-8}" "$@"
