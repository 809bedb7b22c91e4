# Set-up and the two commands a newcomer needs: `make demo` (the main job) and `make test`.
# Each creates .venv and installs what is missing, so both work on a fresh machine.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The torch the tests are run with (override: make TORCH_SPEC=...); the package needs torch>=2.6.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test test-fast test-other-kernels docs docs-serve setup system-deps clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test,export,tune,docs,etcd]"
	touch $@

setup: $(VENV)/.installed

# The launchers the e2e tests run for real, from the distribution: OpenMPI and MPICH (mpirun,
# mpiexec), Slurm with munge (a one-node cluster that the tests start and stop themselves), and
# PostgreSQL (a server `dptrain tune --storage postgresql://` is tested against, started by the test),
# etcd (the three-member clusters `--rdzv-backend etcd` is tested against, started by the tests),
# and a C compiler (the native TAGI step is built at first use; without one it is skipped).
SYSTEM_PACKAGES := openmpi-bin mpich slurmd slurmctld slurm-client munge postgresql etcd-server gcc
SYSTEM_COMMANDS := mpirun.openmpi mpiexec.mpich slurmd slurmctld srun munged pg_ctlcluster etcd cc
system-deps:
	@for c in $(SYSTEM_COMMANDS); do command -v $$c >/dev/null || missing=1; done; \
	[ -z "$$missing" ] || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $(SYSTEM_PACKAGES); }

demo: setup
	$(VENV)/bin/dptrain train

test: setup system-deps
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not dist and not e2e and not slow"

# The tests that compare figures with ones recorded on another machine (marker `recorded`),
# all of them, with other kernels than this CPU's own doing the arithmetic: torch's portable
# kernels and MKL's most compatible path, the configuration tests/e2e/test_other_kernels.py
# re-runs the fast ones under. A comparison too tight for another CPU fails here.
test-other-kernels: setup
	ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE $(PY) -m pytest -q -m recorded

# The documentation site, built into site/ in strict mode (a broken link, a missing page or a
# docstring reference that does not resolve fails it); docs-serve previews it while you edit.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

docs-serve: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

clean:
	rm -rf $(VENV) build site src/*.egg-info .pytest_cache
