# The two commands a newcomer runs: `make demo` and `make test`.
# Everything they need is installed here, from the package registries only.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv prepare demo test unit lint docs clean

venv: $(STAMP)

# Dependencies once per machine (keyed by pyproject.toml's dependencies and the extras installed), this clone editable in its own .venv:
# see hack/venv.sh. torch goes in first and pinned, so Ray and transformers never pull another build.
$(STAMP): pyproject.toml hack/venv.sh
	PYTHON=$(PYTHON) hack/venv.sh $(VENV) workload,jax,local,test "torch==2.13.*"
	touch $(STAMP)

# The Go tools and the images build beside the venv: on a cold machine the compiles and image
# builds take the CPU and disk while pip downloads (tpuft_local.prepare is stdlib only, so the
# machine's python3 runs it); `cluster up` then finds them cached. Warm, `prepare` takes seconds.
demo:
	$(MAKE) --no-print-directory -j2 venv prepare
	$(VENV)/bin/tpuft demo

prepare:
	PYTHONPATH=local $(PYTHON) -m tpuft_local.prepare

# Fast tiers first (a broken unit test fails in a minute), then four lanes at once (the cluster's
# real node, its simulated TPU hosts, integration/chart, and the Ray workload), then `tpuft cluster down`;
# prints each tier's time and the 30 slowest tests. See tests/lanes.py; logs in .test-logs/.
# The Go tools are built by the cluster lane's `tpuft cluster up`, beside the images, on a cold
# machine; the other lanes' control planes wait for them (a build lock).
test: venv
	$(PY) -m tests.lanes

# The unit tier needs neither torch nor Ray: a light venv of its own (seconds to build from
# pip's cache), so `make unit` and `make lint` never wait for the workload's dependencies.
UNIT_VENV  ?= .venv-unit
UNIT_PY    := $(UNIT_VENV)/bin/python
UNIT_STAMP := $(UNIT_VENV)/.installed

$(UNIT_STAMP): pyproject.toml hack/venv.sh
	PYTHON=$(PYTHON) hack/venv.sh $(UNIT_VENV) local,test,lint
	touch $(UNIT_STAMP)

unit: $(UNIT_STAMP)
	$(UNIT_PY) -m pytest -q tests/unit

# ruff; the import contracts (which package may import which: pyproject's [tool.importlinter]);
# mypy over operator/ ([tool.mypy]; its cache in .mypy_cache keeps a rerun to seconds); the docs.
lint: $(UNIT_STAMP)
	$(UNIT_PY) -m ruff check .
	$(UNIT_PY) -c "from importlinter.cli import lint_imports_command; lint_imports_command()" --no-logo  # no -m entry point
	$(UNIT_PY) -m mypy
	$(MAKE) --no-print-directory docs

# The docs site (mkdocs.yml, docs/) into site/: --strict fails on a broken link or anchor and on a
# page left out of nav. Not --quiet: it drops the warnings before --strict counts them, and passes.
# mkdocs-material's banner about its end of life is not ours to print in CI.
docs: $(UNIT_STAMP)
	NO_MKDOCS_2_WARNING=1 $(UNIT_PY) -m mkdocs build --strict

# The dependency venvs stay in ~/.cache/tpuft/venvs (the newest two keys of each are kept).
clean:
	rm -rf $(VENV) $(UNIT_VENV) .pytest_cache .test-logs site
