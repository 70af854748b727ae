# The two commands a newcomer runs: `make demo` and `make test`.
# Everything they need is installed here, from the package registries only.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv demo test unit clean

venv: $(STAMP)

# torch goes in first and pinned, so Ray and transformers never pull another build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.*"
	$(PY) -m pip install -q -e ".[workload,local,test]"
	touch $(STAMP)

demo: venv
	$(VENV)/bin/tpuft demo

test: venv
	$(VENV)/bin/tpuft cluster tools
	RAY_AUTH_MODE=disabled $(PY) -m pytest -q tests

unit: venv
	RAY_AUTH_MODE=disabled $(PY) -m pytest -q tests/unit

clean:
	rm -rf $(VENV) .pytest_cache
