#!/usr/bin/env bash
# The GPU script (issue 14): one run, under 8 minutes of device time on an H200. With Qwen3.5-4B
# in the HF cache:
#   SEMIF_MODEL=Qwen/Qwen3.5-4B SEMIF_REVISION=<40-hex commit> bench/gpu/run.sh
# Without SEMIF_MODEL it serves random weights with Qwen3.5-4B's config (saved as a snapshot).
# Reports start-to-ready cold and on restart, the first decision after ready vs the warm p50,
# the 2k /decide p50 server-side, shape777-like shared throughput, argmax flips shared vs fresh
# and the fast-vs-reference kernel ratio; runs with flash-linear-attention but no causal-conv1d
# too (the output says so). Prints one JSON document and writes
# bench/results/<host>-<date>-gpu.json. `--smoke`: the same on a tiny model on the CPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec "${PYTHON:-.venv/bin/python}" bench/gpu/run.py "$@"
