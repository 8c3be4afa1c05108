#!/usr/bin/env bash
# The benchmark suites on a GPU host (bf16). With Qwen3.5-4B in the HF cache:
#   SEMIF_MODEL=Qwen/Qwen3.5-4B SEMIF_REVISION=<40-hex commit> bench/gpu/run.sh
# Without a snapshot it measures speed on random weights with Qwen3.5-4B's config. Runs once
# with the fast linear-attention kernels (when flash-linear-attention and causal-conv1d import)
# and once without; prints one JSON document and writes bench/results/<host>-<date>-gpu.json.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec "${PYTHON:-.venv/bin/python}" bench/gpu/run.py "$@"
