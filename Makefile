# The two commands a newcomer runs: `make demo` and `make test`.
# Everything they need is installed here, from the package registries only.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv demo test unit lint clean

venv: $(STAMP)

# torch goes in first and pinned, so Ray and transformers never pull another build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.*"
	$(PY) -m pip install -q -e ".[workload,jax,local,test]"
	touch $(STAMP)

demo: venv
	$(VENV)/bin/tpuft demo

# Fast tiers first (a broken unit test fails in a minute), then three lanes at once (the cluster's
# real node, its simulated TPU hosts, and integration/chart/workload), then `tpuft cluster down`;
# prints each tier's time and the 30 slowest tests. See tests/lanes.py; logs in .test-logs/.
test: venv
	$(VENV)/bin/tpuft cluster tools
	RAY_AUTH_MODE=disabled $(PY) -m tests.lanes

# The unit tier needs neither torch nor Ray: a light venv of its own (seconds to build from
# pip's cache), so `make unit` and `make lint` never wait for the workload's dependencies.
UNIT_VENV  ?= .venv-unit
UNIT_PY    := $(UNIT_VENV)/bin/python
UNIT_STAMP := $(UNIT_VENV)/.installed

$(UNIT_STAMP): pyproject.toml
	$(PYTHON) -m venv $(UNIT_VENV)
	$(UNIT_PY) -m pip install -q --upgrade pip
	$(UNIT_PY) -m pip install -q -e ".[local,test,lint]"
	touch $(UNIT_STAMP)

unit: $(UNIT_STAMP)
	$(UNIT_PY) -m pytest -q tests/unit

lint: $(UNIT_STAMP)
	$(UNIT_VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) $(UNIT_VENV) .pytest_cache
