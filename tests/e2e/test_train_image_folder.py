"""`dptrain train --dataset imagefolder:DIR` with DataLoader workers, for real: 2 processes,
an image folder written from scikit-learn's digits (PNG and JPEG), learning as the in-memory
digits do, a kill and resume that ends bit-identical (contract 3), no worker left behind
whatever ends the job (contract 9), and a corrupt image one line with the checkpoints intact
(contract 6)."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests._cli import base_env, dptrain_cmd, run, stop
from tests._images import write_digits_folder

pytestmark = pytest.mark.e2e

NETWORK = ["--model", "tagi-cnn", "--nproc", "2", "--no-progress"]
SMALL = [*NETWORK, "--image-size", "8"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_digits_folder(tmp_path_factory.mktemp("digits"))


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_an_image_folder_learns_as_the_same_digits_in_memory(folder, tmp_path):
    """8x8 again (the folder holds them 3x upscaled), no augmentation: the same network on the
    same images as `digits-image` (measured 4.72 % vs 4.44 % after 3 epochs; 360 test images
    put one standard error near 1.1 %)."""
    common = [*NETWORK, "--epochs", "3", "--no-augment"]
    files = run(dptrain_cmd("train", "--dataset", f"imagefolder:{folder}", "--image-size", "8",
                            "--workers", "2", *common, "--out", str(tmp_path / "folder")),
                timeout_s=180)
    assert files.returncode == 0, files.output
    memory = run(dptrain_cmd("train", "--dataset", "digits-image", *common, "--out",
                             str(tmp_path / "memory")), timeout_s=180)
    assert memory.returncode == 0, memory.output
    folder_error = _summary(tmp_path / "folder")["test_error"]
    assert folder_error < 0.08
    summary = _summary(tmp_path / "folder")
    assert 0 <= summary["data_wait_share"] < 1 and summary["train_time_s"] > 0
    assert abs(folder_error - _summary(tmp_path / "memory")["test_error"]) < 0.03


def test_a_rank_killed_with_workers_resumes_bit_identically(folder, tmp_path):
    """Augmentation on (random resized crops drawn from seed, epoch and index); the killed run
    prefetched batches it never trained on; the reference decodes in the training process."""
    common = ["--dataset", f"imagefolder:{folder}", *SMALL, "--epochs", "2", "--batch-size",
              "64", "--checkpoint-every", "7"]
    killed = run(dptrain_cmd("train", *common, "--workers", "2", "--fail-at", "1:16",
                             "--max-restarts", "1", "--out", str(tmp_path / "killed")),
                 timeout_s=240)
    assert killed.returncode == 0, killed.output
    whole = run(dptrain_cmd("train", *common, "--workers", "0", "--out",
                            str(tmp_path / "whole")), timeout_s=240)
    assert whole.returncode == 0, whole.output
    resumed = _summary(tmp_path / "killed")
    assert resumed["resumed_from"].endswith("step-00000014"), resumed["resumed_from"]
    assert resumed["params_sha256"] == _summary(tmp_path / "whole")["params_sha256"]


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


@pytest.mark.parametrize("how", ["sigterm", "ctrl-c", "ctrl-c twice", "killed rank",
                                 "bad image"])
def test_no_process_outlives_its_job(folder, tmp_path, how):
    """The launcher, both ranks and each rank's 2 loader workers: all gone within seconds."""
    data = folder
    if how == "bad image":  # an expected error in one rank, met by its evaluation's worker
        data = tmp_path / "digits"  # after the first epoch, so every worker is running by then
        shutil.copytree(folder, data)
        bad = sorted((data / "val" / "digit3").glob("*.png"))[2]
        bad.write_bytes(bad.read_bytes()[:64])
    args = ["--dataset", f"imagefolder:{data}", *SMALL, "--epochs", "50", "--workers", "2",
            "--mean", "0.3", "--std", "0.4", "--out", str(tmp_path / "run")]
    if how == "killed rank":
        args += ["--fail-at", "1:60"]  # in the second epoch: the job has started by then
    proc = subprocess.Popen(dptrain_cmd("train", *args), env=base_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline, started = time.monotonic() + 90, set()
        while time.monotonic() < deadline and proc.poll() is None and (
                how in ("killed rank", "bad image") or len(_alive(started)) < 6):
            started |= _descendants(proc.pid)  # 2 ranks and each rank's 2 loader workers
            time.sleep(0.1)
        assert len(started) >= 6, f"the job did not start its ranks and workers: {started}"
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        elif how.startswith("ctrl-c"):
            os.killpg(proc.pid, signal.SIGINT)  # a terminal sends it to the whole group
            if how == "ctrl-c twice":
                time.sleep(0.3)
                os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
        started |= _descendants(proc.pid)
        deadline = time.monotonic() + 15
        while _alive(started) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(started), f"left behind: {sorted(_alive(started))}"
        assert proc.returncode != 0
    finally:
        stop(proc)


def test_a_corrupt_image_met_mid_epoch_is_one_line_and_keeps_the_checkpoints(folder, tmp_path):
    root = tmp_path / "digits"
    shutil.copytree(folder, root)
    first = run(dptrain_cmd("train", "--dataset", f"imagefolder:{root}", *SMALL, "--epochs",
                            "1", "--mean", "0.3", "--std", "0.4", "--workers", "2", "--out",
                            str(tmp_path / "run")), timeout_s=180)
    assert first.returncode == 0, first.output
    saved = {p.name: (p / "state.pt").read_bytes() for p in (tmp_path / "run" / "checkpoints")
             .glob("step-*")}
    bad = sorted((root / "train" / "digit7").glob("*.png"))[3]
    bad.write_bytes(bad.read_bytes()[:64])
    second = run(dptrain_cmd("train", "--dataset", f"imagefolder:{root}", *SMALL, "--epochs",
                             "2", "--mean", "0.3", "--std", "0.4", "--workers", "2", "--out",
                             str(tmp_path / "run")), timeout_s=180)
    assert second.returncode == 3, second.output
    lines = [line for line in second.stderr.splitlines() if "not a readable image" in line]
    assert len(lines) == 1 and str(bad) in lines[0], second.stderr
    assert "Traceback" not in second.stderr
    after = {p.name: (p / "state.pt").read_bytes() for p in (tmp_path / "run" / "checkpoints")
             .glob("step-*")}
    assert after == saved
    skipping = run(dptrain_cmd("train", "--dataset", f"imagefolder:{root}", *SMALL, "--epochs",
                               "1", "--bad-images", "skip", "--workers", "2", "--out",
                               str(tmp_path / "skipping")), timeout_s=180)
    assert skipping.returncode == 0, skipping.output
    summary = _summary(tmp_path / "skipping")
    assert summary["skipped_samples"] == 1 and str(bad) in summary["skipped_examples"][0]


def test_your_own_dataset_file_trains_on_two_processes_with_workers_and_predicts(tmp_path):
    from tests.unit.data.test_user_dataset import SQUARES

    (tmp_path / "my_data.py").write_text(SQUARES)
    spec = f"{tmp_path / 'my_data.py'}:squares"
    out = tmp_path / "run"
    trained = run(dptrain_cmd("train", "--dataset", spec, "--model", "tagi-mlp", "--hidden",
                              "16", "--nproc", "2", "--workers", "1", "--epochs", "3",
                              "--batch-size", "20", "--sigma-v", "0.1", "--no-progress",
                              "--out", str(out)), timeout_s=180)
    assert trained.returncode == 0, trained.output
    summary = _summary(out)
    assert summary["test_rmse"] < 0.15  # y = x² on [-1, 1]: the mean alone is off by 0.3
    predicted = run(dptrain_cmd("predict", str(out), "--out", str(tmp_path / "p.csv")),
                    timeout_s=120)
    assert predicted.returncode == 0, predicted.output
    # predict reads best/: the epoch the validation part chose, whose test RMSE epochs.csv has
    with open(out / "epochs.csv") as f:
        best = list(csv.DictReader(f))[summary["best_epoch"] - 1]
    assert f"rmse {float(best['test_rmse']):.4g}" in predicted.output
