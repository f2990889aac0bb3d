# podshim — the two commands are `make demo` (the main job) and `make test` (the suite).
# Both run the idempotent set-up first, so either works alone on a fresh Debian 12 machine.

PY := .venv/bin/python
PYTEST := .venv/bin/pytest
RUFF := .venv/bin/ruff
MYPY := .venv/bin/mypy

.PHONY: setup demo test test-core test-matrix test-kubelet test-cluster test-fast lint docs proto up down conformance deb bench bench-proxy bench-checkpoint bench-restore bench-load bench-node bench-distribution bench-migrate bench-kubelet bench-cluster bench-front-kill bench-peers bench-report

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) -m testbed.demo
	$(PY) -m testbed.cluster_demo

# What CI runs (docs/testing.md, Compatibility): the checks of `make lint` first (written out, not a sub-make:
# make runs a recipe line that calls $(MAKE) even under `make -n`), then the whole suite on the
# default upstream (containerd 1.6, the system's; the package's install test included), then the
# end-to-end core on containerd 2.2, and on the newest runtimes a node runs, containerd 2.4 with
# runc 1.3 and CRIU 4.2 (with the CRIU patches' tests). The other combinations: `make test-matrix`.
# All run even when one fails; the target fails if any did.
test: setup
	@rc=0; \
	echo "==> lint: ruff check, ruff format --check, mypy"; \
	$(RUFF) check . || rc=1; \
	$(RUFF) format --check . || rc=1; \
	$(MYPY) || rc=1; \
	echo "==> the whole suite on containerd 1.6"; \
	PODSHIM_TEST_CONTAINERD=1.6 $(PYTEST) -ra --durations=25 || rc=1; \
	echo "==> the end-to-end core on containerd 2.2"; \
	PODSHIM_TEST_CONTAINERD=2.2 $(PYTEST) -ra --durations=25 -m core || rc=1; \
	echo "==> the end-to-end core on containerd 2.4, runc 1.3, CRIU 4.2"; \
	PODSHIM_TEST_CONTAINERD=2.4 PODSHIM_TEST_RUNC=1.3 PODSHIM_TEST_CRIU=4.2 $(PYTEST) -ra --durations=25 -m "core or criu or newest" || rc=1; \
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

# What CI leaves to a weekly run (docs/testing.md, Compatibility): the core on the other combinations, one
# runtime changed at a time, and the package installed on Debian 13 (trixie). All run even when one
# fails; the target fails if any did.
MATRIX := 1.7:1.1:4.1 2.1:1.1:4.1 2.4:1.1:4.1 1.6:1.3:4.1 1.6:1.1:4.2
test-matrix:
	PODSHIM_DEBROOTS="bookworm trixie" bash scripts/setup.sh
	@rc=0; \
	for combo in $(MATRIX); do \
		c=$${combo%%:*}; r=$${combo#*:}; r=$${r%%:*}; k=$${combo##*:}; \
		echo "==> the end-to-end core on containerd $$c, runc $$r, CRIU $$k"; \
		m=core; [ "$$k" = 4.1 ] || m="core or criu"; \
		PODSHIM_TEST_CONTAINERD=$$c PODSHIM_TEST_RUNC=$$r PODSHIM_TEST_CRIU=$$k $(PYTEST) -ra -m "$$m" || rc=1; \
	done; \
	echo "==> the package installed on Debian 13"; \
	PODSHIM_TEST_DEBIAN=trixie $(PYTEST) -ra tests/test_package.py || rc=1; \
	exit $$rc

# A real kubelet (v1.37, standalone, static pods) on podshim: tests/test_kubelet.py (also in `make test`).
test-kubelet: setup
	$(PYTEST) -ra -m kubelet

# A real control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler) and a registered
# kubelet on podshim: tests/cluster (testbed/cluster.py; also in `make test`).
test-cluster: setup
	$(PYTEST) -ra tests/cluster

# Unit tests only (no containerd, no root needed for most).
test-fast:
	$(PYTEST) -ra -m "not e2e"

# The node's package: dist/podshim_<version>_amd64.deb (scripts/build-deb.sh; docs/install.md).
deb: setup
	bash scripts/build-deb.sh dist

# ruff's checks and format, and mypy over shim/ testbed/ bench/ conformance/ ([tool.mypy]).
lint:
	$(RUFF) check .
	$(RUFF) format --check .
	$(MYPY)

# docs/reference/ (config.md, cli.md and a page per command in cli/, metrics.md) and the manual pages in
# docs/man/ from the code (shim/docgen.py; tests/test_reference_docs.py fails when one is stale), then
# the site: mkdocs.yml, into site/ (a warning, e.g. a broken link or a page not in the nav, fails it).
docs:
	$(PY) -m shim.docgen
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

proto:
	bash scripts/gen_proto.sh

# critest through podshim and straight at containerd, the checkpoint conformance suite and a crictl
# tour, offline (conformance/full.py): against a bed of its own, or ENDPOINT=unix://… (`make up`'s).
ENDPOINT ?=
conformance: setup
	$(PY) -m conformance.full $(if $(ENDPOINT),--endpoint $(ENDPOINT))

# A private containerd + podshim in the background; prints PODSHIM_SOCKET=… and CONTAINERD_SOCKET=….
# CLUSTER=1: with a Kubernetes control plane and a kubelet registered as its node; prints KUBECONFIG=….
up: setup
	@$(PY) -m testbed up $(if $(BED),--name $(BED)) $(if $(CLUSTER),--cluster)

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

# a pod checkpoint through an OCI registry: push/pull vs cp+sync, checkpoint on A → running on B
bench-distribution: setup
	$(PY) -m bench.distribution

# live migration between two nodes: downtime, total, the wire floor, the registry path;
# a short run: make bench-migrate MIGRATE_ARGS="--sizes 64 --skip-registry"
MIGRATE_ARGS ?=
bench-migrate: setup
	$(PY) -m bench.migrate $(MIGRATE_ARGS)

# A full node under a real kubelet (100 static pods), pointed at podshim and straight at containerd
# (bench/kubelet.py).
bench-kubelet: setup
	$(PY) -m bench.kubelet --rounds 2

# What a client of podshim's socket sees while the front is killed and restarted.
bench-front-kill: setup
	$(PY) -m bench.front_kill --kills 8

# The cluster API's cost over the CRI calls it makes, beside a cold start (docs/cluster.md).
bench-cluster: setup
	$(PY) -m bench.cluster --rounds 3

# podshim beside Podman and containerd's own CRI checkpoint (bench/peers.py); PEERS_ARGS="--sizes 4,1024,4096"
# adds 4 GiB
PEERS_ARGS ?=
bench-peers: setup
	$(PY) -m bench.peers $(PEERS_ARGS)

# docs/performance.md and its plots from the latest bench/results/*.json (bench/report.py)
bench-report: setup
	$(PY) -m bench.report

bench: bench-proxy bench-checkpoint bench-restore bench-load bench-node bench-distribution bench-migrate
