#!/usr/bin/env bash
# Creates bench/.venv-pytagi with the reference library pytagi 0.2.1, for the benchmarks of
# bench/pytagi/ (and bench/tagi/'s that run pytagi beside dptrain: tagi_stability.py,
# tagi_conv_vs_torch.py).
#
# The PyPI wheel of pytagi 0.2.1 is a CUDA+NCCL+MPI build, even when it runs on the CPU only:
# its extension links libmpi.so.40 and libmpi_cxx.so.40 (Debian's libopenmpi3) and libnccl.so.2
# (pip's nvidia-nccl-cu12; the loader finds it only through LD_LIBRARY_PATH, which
# tagi_vs_pytagi.py sets for the worker). It does not declare numpy, which it imports.
#
#   bash bench/pytagi/setup_pytagi.sh     # idempotent; PYTHON=python3.11 to pick the interpreter
set -euo pipefail
cd "$(dirname "$0")/.."  # bench/: the venv is bench/.venv-pytagi, whichever topic runs it
PYTHON=${PYTHON:-python3}
VENV=.venv-pytagi
# tqdm, pandas, matplotlib, scikit-learn, torch: what pytagi's tutorials import
# (pytagi_tutorials_vs_wheel.py)
REQS=(pytagi==0.2.1 nvidia-nccl-cu12 "numpy<3" tqdm pandas matplotlib scikit-learn torch)

if ! ldconfig -p | grep -q 'libmpi_cxx\.so\.40'; then
  echo "setup_pytagi: installing libopenmpi3 (pytagi's extension links OpenMPI 4)" >&2
  if [ "$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libopenmpi3
fi

# The stamp holds the requirement list, so changing REQS reinstalls.
if [ "$(cat "$VENV/.installed" 2>/dev/null)" != "${REQS[*]}" ]; then
  test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${REQS[@]}"
  echo "${REQS[*]}" > "$VENV/.installed"
fi
