# podshim — the two commands are `make demo` (the main job) and `make test` (the suite).
# Both run the idempotent set-up first, so either works alone on a fresh Debian 12 machine.

PY := .venv/bin/python
PYTEST := .venv/bin/pytest

.PHONY: setup demo test test-fast lint proto up down conformance bench bench-proxy bench-checkpoint bench-restore bench-load

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) -m testbed.demo

test: setup
	$(PYTEST) -ra

# Unit tests only (no containerd, no root needed for most).
test-fast:
	$(PYTEST) -ra -m "not e2e"

lint:
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

proto:
	bash scripts/gen_proto.sh

# The pod checkpoint conformance suite against a running endpoint: make conformance ENDPOINT=unix:///run/podshim/podshim.sock
ENDPOINT ?= unix:///run/podshim/podshim.sock
conformance: setup
	$(PY) -m conformance --runtime-endpoint $(ENDPOINT)

# A private containerd + podshim in the background; prints PODSHIM_SOCKET=… and CONTAINERD_SOCKET=….
up: setup
	@$(PY) -m testbed up

down:
	@$(PY) -m testbed down

bench-proxy: setup
	$(PY) -m bench.proxy

bench-checkpoint: setup
	$(PY) -m bench.checkpoint

bench-restore: setup
	$(PY) -m bench.restore

bench-load: setup
	$(PY) -m bench.load

bench: bench-proxy bench-checkpoint bench-restore bench-load
