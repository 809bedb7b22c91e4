"""The seed's DDP example, pytagi's examples/ddp_cifar_resnet.py, on the CPU under mpirun on 2
processes (issue 29): its imports rewritten, then the smallest patch that makes it run without
CUDA (ddp_cifar_resnet_cpu.diff: gloo instead of NCCL, the CPU as device, and pytagi's own
CIFAR-10 binary reader, `Utils.load_cifar_images`, instead of torchvision's downloading one),
on generated CIFAR-10 binary batches. Unchanged but for its imports it is the GPU tier's."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from dptrain.data.datasets.synthetic import synthetic_images
from tests._cli import PYTHON, base_env, mpirun_cmd, run
from tests._world import free_port
from tests.pytagi_programs.rewrite import port_tree
from tests.pytagi_programs.test_pytagi_programs import SKIP, SOURCE

pytestmark = pytest.mark.e2e
PATCH = Path(__file__).with_name("ddp_cifar_resnet_cpu.diff")
RESULT = re.compile(r"Epoch 1/1 \| train error: ([\d.]+)% \| test error: ([\d.]+)%")


def _write_cifar_binary(directory: Path) -> None:
    """data_batch_1..5.bin and test_batch.bin: records of a label byte and 3x32x32 pixels."""
    directory.mkdir(parents=True)
    for name, num, seed in [*((f"data_batch_{k}.bin", 8, k) for k in range(1, 6)),
                            ("test_batch.bin", 16, 9)]:
        images, labels = synthetic_images(num, 3, 32, seed)
        records = np.concatenate([labels[:, None], images.reshape(num, -1)], axis=1)
        (directory / name).write_bytes(records.astype(np.uint8).tobytes())


def test_ddp_cifar_resnet_runs_on_two_cpu_processes_under_mpirun(tmp_path):
    if SOURCE is None:
        pytest.skip(SKIP)
    pytest.importorskip("mpi4py", reason="the example uses mpi4py (a test dependency)")
    port_tree(SOURCE / "examples", tmp_path / "examples")
    subprocess.run(["git", "apply", str(PATCH)], cwd=tmp_path, check=True)
    _write_cifar_binary(tmp_path / "data" / "cifar")
    env = base_env(PYTHONPATH=str(tmp_path), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()))
    exported = [flag for name in ("PYTHONPATH", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME",
                                  "MASTER_ADDR", "MASTER_PORT") for flag in ("-x", name)]
    done = run(mpirun_cmd(2, *exported, PYTHON, "examples/ddp_cifar_resnet.py",
                          "--num_epochs=1", "--batch_size=8", "--num_workers=0"),
               cwd=tmp_path, env=env, timeout_s=300)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-3000:]
    assert "Process 0 of 2" in text and "Process 1 of 2" in text, text[-2000:]
    assert RESULT.search(text), f"no closing error figures:\n{text[-2000:]}"
