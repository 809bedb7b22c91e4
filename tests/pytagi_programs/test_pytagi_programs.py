"""pytagi 0.2.1's own programs (examples, unit tests, tutorial notebooks) run on dptrain.pytagi
with only their import lines rewritten (rewrite.py), to the end, with tiny epoch counts
(issue 29; docs/tutorials/from_pytagi.md).

The programs are pytagi's (MIT) and not shipped here: they are read from $DPTRAIN_PYTAGI_PROGRAMS
or from a pytagi-0.2.1 checkout beside the repository's parent, and the tier skips in one line
where neither exists (get them from cuTAGI's tag v0.2.1).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from dptrain.data.datasets.synthetic import write_synthetic_mnist
from tests._cli import PYTHON, REPO, base_env, run
from tests.pytagi_programs.rewrite import port_tree, rewrite_line

pytestmark = pytest.mark.e2e


def _source() -> Path | None:
    """$DPTRAIN_PYTAGI_PROGRAMS when set (and then only it), else the checkout beside the
    repository's parent."""
    named = os.environ.get("DPTRAIN_PYTAGI_PROGRAMS")
    candidate = Path(named) if named else REPO.parent / "shared" / "pytagi-0.2.1"
    return candidate if (candidate / "examples").is_dir() else None


SOURCE = _source()
SKIP = ("pytagi 0.2.1's programs not found (no examples/ in "
        f"{os.environ.get('DPTRAIN_PYTAGI_PROGRAMS') or 'the default place'}): set "
        "DPTRAIN_PYTAGI_PROGRAMS to a checkout of cuTAGI's tag v0.2.1")

# (name, command after `python`, what the program prints at its end: a finite figure (nan or
# inf would not match) or its unittest verdict)
PROGRAMS = [
    ("regression", ["examples/regression.py", "--num_epochs=2"],
     r"Log-likelihood:\s*-?\d+\.\d+"),
    ("regression_heteros", ["examples/regression_heteros.py", "--num_epochs=2"],
     r"Log-likelihood:\s*-?\d+\.\d+"),
    ("time_series_forecasting", ["examples/time_series_forecasting.py", "--num_epochs=1"],
     r"Log-likelihood:\s*-?\d+\.\d+"),
    ("time_series_smoother", ["examples/time_series_smoother.py", "--num_epochs=1"],
     r"Log-likelihood:\s*-?\d+\.\d+"),
    ("test_load_state_dict", ["examples/test_load_state_dict.py"],
     r"LOAD STATE DICT TEST PASSED"),
    # pytagi's unit tests, run as its test/py_unit/main.py --cpu runs them (their CUDA cases
    # skip); test_mnist reads the generated MNIST-format files
    *((f"py_unit/{name}", ["-m", "unittest", "discover", "-s", "test/py_unit", "-t",
                           "test/py_unit", "-p", f"{name}.py"], r"\nOK")
      for name in ("test_fnn_heteros", "test_embedding", "test_load_state_dict", "test_lstm",
                   "test_mnist")),
]

# The programs run seeded like the notebooks (below), since pytagi's own test_lstm draws fresh
# weights each run and fails its 0.5 MSE threshold on some draws, in pytagi as on dptrain
# (400 draws each: pytagi 0.2.1 failed 14, up to 0.78; dptrain.pytagi 9, up to 0.74; both with
# a median of 0.20). Seed 0 is not kept for it: under five kernel paths (ATEN_CPU_CAPABILITY
# default / avx2, MKL_ENABLE_INSTRUCTIONS SSE4_2 / AVX2 / AVX512), the same draw trains to
# anywhere in 0.18-0.35, so another CPU could carry it past 0.5; seed 3 lands in 0.14-0.15.
PROGRAM_SEEDS = {"py_unit/test_lstm": 3}

# Tutorial notebooks (run as scripts of their code cells, in docs/tutorials as a user would):
# the training MSE the notebook recorded at its last epoch, and how far the run may land from
# it. The notebooks seed numpy only, so the initial parameters are a fresh draw every run (in
# pytagi too); unseeded, tutorial 01 ended between 0.09 and 0.25 over 12 runs here. The tier
# seeds torch's generator with 0 before the notebook starts (a sitecustomize on PYTHONPATH,
# the program untouched), so the check is deterministic.
NOTEBOOKS = [
    ("TAGI_Tutorial_01_1D_toy_regression", 0.11, 0.05),
    ("TAGI_Tutorial_02_1D_toy_regression_heteros", 0.23, 0.05),
    ("TAGI_Tutorial_03_LSTM", 0.17, 0.05),
]
LAST_EPOCH_MSE = re.compile(r"Epoch (\d+)/\1\| mse:\s*([\d.]+)")

NEED_OTHER_PACKAGES = {
    "examples/classification.py": "wandb (through examples/param_stat_table.py)",
    "examples/batchnorm_viz.py, param_viz.py, param_stat_table.py": "helper modules, no main",
    "examples/ddp_cifar_resnet.py, ddp_mnist.py, ddp_mnist_torch_dataloader.py, ddp_imagenet.py":
        "torchvision and mpi4py, CUDA and NCCL (the GPU tier)",
    "examples/mnist_bench.py, cifar_resnet_bench.py, imagenet_resnet_bench.py, resnet18_cifar10.py":
        "torchvision's downloading datasets",
    "examples/traffic_2008_01_14.py (and its _debugger copy)": "a data file pytagi does not ship",
}
"""Not run: not a test dependency of dptrain, or not a program."""

NEED_DOWNLOAD = ["docs/tutorials/TAGI_Tutorial_04_MNIST_CNN (torchvision's MNIST)",
                 "docs/tutorials/TAGI_Tutorial_05_CIFAR10_ResNet18 (torchvision's CIFAR-10)"]
"""Not run: they download at run time, which CI cannot."""

TOO_LONG = {
    "examples/autoencoder.py": "ConvTranspose2d decoder; one epoch is pytagi's 60,000 images "
                               "(14 minutes on 2 shared cores), its num_epochs the only knob",
}
"""Not run in the tier: they run to the end here, but take longer than the tier allows."""

NEED_DOWNLOAD_LAYERS = {
    "docs/tutorials/TAGI_Tutorial_06_Autoencoder_MNIST": "ConvTranspose2d, torchvision's MNIST",
    "examples/softmax_mnist.py": "Softmax / ClosedFormSoftmax, torchvision's MNIST",
    "examples/softmax_cifar.py": "Softmax / ClosedFormSoftmax, torchvision's CIFAR-10",
}
"""Not run: they use the engine's ConvTranspose2d and softmax layers (tested on their own in
tests/unit/tagi/test_convtranspose.py, test_tagi_softmax.py), but download their data."""


@pytest.fixture(scope="module")
def ported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if SOURCE is None:
        pytest.skip(SKIP)
    root = tmp_path_factory.mktemp("pytagi_programs")
    port_tree(SOURCE, root)
    (root / "saved_results").mkdir(exist_ok=True)  # pytagi's examples write figures there
    # MNIST-format files of the sizes pytagi's loaders ask for (60000 / 10000 images): noise
    # around a bright square whose position is the label
    write_synthetic_mnist(root / "data" / "mnist", num_train=60000, num_test=10000)
    # tutorial 03 fetches pytagi's toy time series with shell lines (dropped): put them there
    for csv in (root / "data" / "toy_time_series").glob("*.csv"):
        (root / "docs" / "tutorials" / csv.name).write_bytes(csv.read_bytes())
    (root / "_seed").mkdir()
    (root / "_seed" / "sitecustomize.py").write_text(
        "import os\nimport torch\ntorch.manual_seed(int(os.environ.get('TIER_SEED', '0')))\n")
    return root


@pytest.mark.parametrize("name,command,figure", PROGRAMS, ids=[p[0] for p in PROGRAMS])
def test_program_runs_to_the_end(ported, name, command, figure):
    env = base_env(PYTHONPATH=f"{ported / '_seed'}{os.pathsep}{ported}", MPLBACKEND="Agg",
                   TEST_CPU_ONLY="1", TIER_SEED=str(PROGRAM_SEEDS.get(name, 0)))
    done = run([PYTHON, *command], cwd=ported, env=env, timeout_s=240)
    text = done.stdout + done.stderr
    assert done.returncode == 0, f"{name} failed:\n{text[-3000:]}"
    assert re.search(figure, text), f"{name}: its closing figure is missing:\n{text[-2000:]}"


def test_the_rewriter_changes_import_lines_only():
    assert rewrite_line("import pytagi") == "import dptrain.pytagi as pytagi"
    assert rewrite_line("import pytagi.metric as metric") == \
        "import dptrain.pytagi.metric as metric"
    assert rewrite_line("    from pytagi.nn import (") == "    from dptrain.pytagi.nn import ("
    assert rewrite_line("from pytagi import Normalizer as normalizer") == \
        "from dptrain.pytagi import Normalizer as normalizer"
    for untouched in ("x = pytagi.Utils()", "import pytagiextra", "# import pytagi",
                      "print('from pytagi import x')"):
        assert rewrite_line(untouched) == untouched


@pytest.mark.recorded
@pytest.mark.parametrize("name,recorded,tolerance", NOTEBOOKS, ids=[n[0] for n in NOTEBOOKS])
def test_notebook_runs_and_matches_its_recorded_training_mse(ported, name, recorded, tolerance):
    """Issue 29: before flat outputs, tutorial 01 ended at 0.45 (a (B, 1) - (B,) broadcast)
    where the notebook records 0.11."""
    env = base_env(PYTHONPATH=f"{ported / '_seed'}{os.pathsep}{ported}", MPLBACKEND="Agg")
    done = run([PYTHON, f"{name}.py"], cwd=ported / "docs" / "tutorials", env=env,
               timeout_s=240)
    text = done.stdout + done.stderr
    assert done.returncode == 0, f"{name} failed:\n{text[-3000:]}"
    found = LAST_EPOCH_MSE.findall(text)
    assert found, f"{name}: no last-epoch training MSE printed:\n{text[-2000:]}"
    assert abs(float(found[-1][1]) - recorded) <= tolerance, (name, found[-1], recorded)
