# podshim — the two commands are `make demo` (the main job) and `make test` (the suite).
# Both run the idempotent set-up first, so either works alone on a fresh Debian 12 machine.

PY := .venv/bin/python
PYTEST := .venv/bin/pytest

.PHONY: setup demo test test-core test-kubelet test-fast lint proto up down conformance deb bench bench-proxy bench-checkpoint bench-restore bench-load bench-node bench-distribution bench-migrate bench-kubelet

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) -m testbed.demo

# The whole suite on the default upstream (containerd 1.6, the system's), then the end-to-end core
# (`-m core`, tests/conftest.py) on containerd 1.7 and 2.1 (the set-up's private prefix). All three
# run even when one fails; the target fails if any did.
test: setup
	@rc=0; \
	echo "==> the whole suite on containerd 1.6"; \
	PODSHIM_TEST_CONTAINERD=1.6 $(PYTEST) -ra || rc=1; \
	for v in 1.7 2.1; do \
		echo "==> the end-to-end core on containerd $$v"; \
		PODSHIM_TEST_CONTAINERD=$$v $(PYTEST) -ra -m core || rc=1; \
	done; \
	exit $$rc

# The end-to-end core on one combination (testbed/bed.py): make test-core CONTAINERD=2.4 RUNC=1.3
# CRIU=4.2 (containerd 1.6 1.7 2.1 2.2 2.4; runc 1.1 1.3; CRIU 4.1 4.2). On another CRIU than the
# default, the tests of podshim's CRIU patches (`-m criu`, tests/conftest.py) run too.
CONTAINERD ?= 1.6
RUNC ?= 1.1
CRIU ?= 4.1
test-core: setup
	PODSHIM_TEST_CONTAINERD=$(CONTAINERD) PODSHIM_TEST_RUNC=$(RUNC) PODSHIM_TEST_CRIU=$(CRIU) \
		$(PYTEST) -ra -m "$(if $(filter 4.1,$(CRIU)),core,core or criu)"


# A real kubelet (v1.37, standalone, static pods) on podshim: tests/test_kubelet.py (also in `make test`).
test-kubelet: setup
	$(PYTEST) -ra -m kubelet

# Unit tests only (no containerd, no root needed for most).
test-fast:
	$(PYTEST) -ra -m "not e2e"

# The node's package: dist/podshim_<version>_amd64.deb (scripts/build-deb.sh; README, Installing a node).
deb: setup
	bash scripts/build-deb.sh dist

lint:
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

proto:
	bash scripts/gen_proto.sh

# critest through podshim and straight at containerd, the checkpoint conformance suite and a crictl
# tour, offline (conformance/full.py): against a bed of its own, or ENDPOINT=unix://… (`make up`'s).
ENDPOINT ?=
conformance: setup
	$(PY) -m conformance.full $(if $(ENDPOINT),--endpoint $(ENDPOINT))

# A private containerd + podshim in the background; prints PODSHIM_SOCKET=… and CONTAINERD_SOCKET=….
up: setup
	@$(PY) -m testbed up $(if $(BED),--name $(BED))

down:
	@$(PY) -m testbed down $(if $(BED),--name $(BED))

bench-proxy: setup
	$(PY) -m bench.proxy

bench-checkpoint: setup
	$(PY) -m bench.checkpoint

bench-restore: setup
	$(PY) -m bench.restore

bench-load: setup
	$(PY) -m bench.load

# What ordinary containers pay for podshim-runc: containerd with runc vs podshim-runc as BinaryName.
bench-node: setup
	$(PY) -m bench.node

# a pod checkpoint through an OCI registry: push/pull vs cp+sync, checkpoint on A → running on B (issue 17)
bench-distribution: setup
	$(PY) -m bench.distribution

# live migration between two nodes: downtime, total, the wire floor, the registry path (issue 27)
bench-migrate: setup
	$(PY) -m bench.migrate

# A full node under a real kubelet (100 static pods), pointed at podshim and straight at containerd
# (bench/kubelet.py, issue 22 item 11).
bench-kubelet: setup
	$(PY) -m bench.kubelet --rounds 2

bench: bench-proxy bench-checkpoint bench-restore bench-load bench-node bench-distribution bench-migrate
