#!/usr/bin/env bash
# The quality run of docs/quality.md on a GPU host: Qwen/Qwen3.5-4B at the pinned revision in the
# local HF cache, with the gpu extra (fast kernels) installed.
#   bench/gpu/quality.sh [OUT_DIR]
# 1. the reference predictions: `semif-serve score` (fresh, outside the server);
# 2. a server on 127.0.0.1:$PORT (started here, stopped on exit);
# 3. accept (with the reference), evaluate (none vs rotations, perturbations included), and
#    calibrate (from the reference's native logits; no extra model calls).
# Any SEMIF_* variable applies (SEMIF_MODEL, SEMIF_REVISION, SEMIF_DTYPE, SEMIF_VRAM_CAP_GIB...).
# Exits with accept's status: 0 accepted, 1 a check failed.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-.venv/bin}
OUT=${1:-bench/results/quality-$(hostname)-$(date +%F)}
PORT=${PORT:-8473}
URL=http://127.0.0.1:$PORT
DATA=bench/data/decisions144.jsonl
PERTURBED=bench/data/perturbations108.jsonl
export SEMIF_MODEL=${SEMIF_MODEL:-Qwen/Qwen3.5-4B}
export SEMIF_REVISION=${SEMIF_REVISION:-851bf6e806efd8d0a36b00ddf55e13ccb7b8cd0a}
export SEMIF_DEVICE=${SEMIF_DEVICE:-cuda}
export SEMIF_DTYPE=${SEMIF_DTYPE:-bfloat16}
export SEMIF_BIND=127.0.0.1:$PORT
mkdir -p "$OUT"

"$BIN/semif-serve" score "$DATA" --model "$SEMIF_MODEL" --revision "$SEMIF_REVISION" \
    --device "$SEMIF_DEVICE" --dtype "$SEMIF_DTYPE" --out "$OUT/reference.jsonl"

"$BIN/semif-serve" serve --token-file "$OUT/token" >"$OUT/server.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true' EXIT
for _ in $(seq 900); do
    curl -sf "$URL/health" >/dev/null && break
    kill -0 "$server" 2>/dev/null || { cat "$OUT/server.log"; exit 2; }
    sleep 1
done

accepted=0
"$BIN/semif-serve" accept --url "$URL" --token-file "$OUT/token" --data "$DATA" \
    --reference "$OUT/reference.jsonl" --repeats 5 --out "$OUT" || accepted=$?
"$BIN/semif-serve" evaluate --data "$DATA" --data "$PERTURBED" --orderings none,rotations \
    --url "$URL" --token-file "$OUT/token" --out "$OUT/evaluate"
"$BIN/semif-serve" calibrate --data "$DATA" --workload decisions144 \
    --results "$OUT/reference.jsonl" --out "$OUT/calibration.json" --report "$OUT/calibration-fit.json"
exit "$accepted"
