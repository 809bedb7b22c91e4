# Set-up and the two commands a newcomer needs: `make demo` (the main job) and `make test`.
# Each creates .venv and installs what is missing, so both work on a fresh machine.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The torch the tests are run with (override: make TORCH_SPEC=...); the package needs torch>=2.6.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test test-fast setup mpi clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

setup: $(VENV)/.installed

# OpenMPI and MPICH from the distribution, for the mpirun / mpiexec tests.
MPI_PACKAGES := openmpi-bin mpich
mpi:
	@command -v mpirun.openmpi >/dev/null && command -v mpiexec.mpich >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq $(MPI_PACKAGES); }

demo: setup
	$(VENV)/bin/dptrain train

test: setup mpi
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not dist and not e2e and not slow"

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
