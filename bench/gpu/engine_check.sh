#!/usr/bin/env bash
# On a GPU host with the model in the HF cache (and the gpu extra installed):
#   SEMIF_API_TOKEN=<32+ chars> SEMIF_VRAM_CAP_GIB=12 bench/gpu/engine_check.sh
# Prints the baseline, the peak at a ~SEMIF_MAX_TOKENS input and the release after a
# 64-decision burst as JSON. Any SEMIF_* variable applies (SEMIF_MODEL, SEMIF_REVISION, ...).
set -euo pipefail
cd "$(dirname "$0")/../.."
export SEMIF_API_TOKEN="${SEMIF_API_TOKEN:-engine-check-token-not-served-0000000}"
exec "${PYTHON:-.venv/bin/python}" bench/gpu/engine_check.py
