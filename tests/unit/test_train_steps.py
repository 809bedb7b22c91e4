"""Steps are first-class (docs/howto/checkpoints.md, Steps and validation points): a run ends
at a global step, mid-epoch if so; it validates every `val_every` steps on the same
`val_batches` batches, and best/, early stopping and steps.csv follow those points; a run that
crashes and resumes ends where an unbroken one ends, steps.csv and all. Also the metrics a
model family adds (`MetricExtras`: token data's perplexity, bits per unit, tokens/s, MFU). One
process here; two, the real SIGKILL and another world size in
tests/e2e/test_train_steps_cli.py."""

from __future__ import annotations

import dataclasses

import csv
import json
import math
from pathlib import Path

import pytest
import torch

from dptrain.data import Split, load_digits
from dptrain.data.datasets.holdout import hold_out
from dptrain.data.datasets.vocabulary import FILE_NAME, Vocabulary
from dptrain.errors import ConfigError
from dptrain.learners.recipes import make_learner
from dptrain.learners.schedule import LrSchedule
from dptrain.runtime import init_distributed
from dptrain.train import TrainConfig, Trainer
from dptrain.train import checkpoint as ckpt
from dptrain.learners.torch_learner import TorchLearner
from dptrain.train.flops import cuda_peak, mfu
from dptrain.train.options import TrainOptions
from dptrain.train.extras import MetricExtras
from dptrain.models import DataSpec
from dptrain.models.gpt import language_metrics as language_report
from dptrain.models.gpt import per_position_figures
from dptrain.train.steps import samples_seen, validation_indices
from dptrain.train.trainer import metric_names

SPLIT = hold_out(load_digits(), 0.1, seed=0)  # 1293 train, 144 validation, 360 test
BATCH = 32
PER_EPOCH = math.ceil(1293 / BATCH)  # 41


class Crash(Exception):
    """Stands for a process killed before a step (the real SIGKILL: the e2e tests)."""


def _learner(crash_at: int | None = None, schedule: LrSchedule | None = None):
    torch.manual_seed(0)
    learner = make_learner("torch-mlp", lr_schedule=schedule)
    if crash_at is not None:
        step = learner.train_step

        def train_step(batch):
            if learner.num_optimizer_steps + 1 == crash_at:
                raise Crash(f"before step {crash_at}")
            return step(batch)

        learner.train_step = train_step
    return learner


def _fit(out: Path, learner=None, split: Split = SPLIT, extras: MetricExtras = MetricExtras(),
         **config) -> dict:
    config = {"batch_size": BATCH, "progress": False, "async_checkpoints": False,
              **config}
    return Trainer(learner or _learner(), split, TrainConfig(out_dir=out, **config),
                   init_distributed(), extras=extras).fit()


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


# --------------------------------------------------------------------------- the pure parts
def test_validation_batches_are_a_fixed_seeded_choice_spread_over_the_part():
    chosen = validation_indices(1000, batches=3, batch_size=32, seed=5)
    assert chosen.tolist() == sorted(set(chosen.tolist())) and len(chosen) == 96
    assert torch.equal(chosen, validation_indices(1000, batches=3, batch_size=32, seed=5))
    assert not torch.equal(chosen, validation_indices(1000, batches=3, batch_size=32, seed=6))
    assert chosen.max() > 900 and chosen.min() < 100  # not the part's first windows only
    assert validation_indices(96, batches=3, batch_size=32, seed=5) is None  # all of it


def test_samples_seen_is_a_function_of_the_step_alone():
    # 41 steps per epoch of 32, the last one holding 13 samples: 1293 per epoch
    assert samples_seen(0, steps_per_epoch=41, global_batch_size=32, num_samples=1293) == 0
    assert samples_seen(40, steps_per_epoch=41, global_batch_size=32, num_samples=1293) == 1280
    assert samples_seen(41, steps_per_epoch=41, global_batch_size=32, num_samples=1293) == 1293
    assert samples_seen(50, steps_per_epoch=41, global_batch_size=32, num_samples=1293) == 1581


def test_perplexity_and_bits_come_from_the_per_token_loss_named_by_the_unit():
    got = per_position_figures("character")({"loss": 1.5, "error": 0.4}, "val")
    assert got == {"val_perplexity": pytest.approx(math.exp(1.5)),
                   "val_bits_per_character": pytest.approx(1.5 / math.log(2))}
    assert set(per_position_figures("byte")({"loss": 2.0}, "test")) == {"test_perplexity",
                                                                      "test_bits_per_byte"}
    assert per_position_figures("token")({"error": 0.1}, "val") == {}
    extras = MetricExtras(derive=per_position_figures("token"))
    assert "val_bits_per_token" in metric_names(["loss", "error"], "val", extras)
    assert "val_perplexity" not in metric_names(["loss", "error"], "val")


def test_mfu_is_model_flops_times_tokens_over_the_devices_peak():
    assert mfu(flops_per_token=6e6, tokens_per_s=1e4, peak=1e12, world_size=2) == \
        pytest.approx(0.03)
    assert cuda_peak("NVIDIA H100 80GB HBM3", torch.bfloat16).rate == 989e12
    assert cuda_peak("NVIDIA A100-SXM4-80GB", torch.float32).rate == 19.5e12
    assert cuda_peak("NVIDIA L40S", torch.bfloat16).rate == 362e12  # not an L4
    unknown = cuda_peak("Some Future GPU", torch.bfloat16)
    assert unknown.rate is None and "--peak-flops" in unknown.source
    module = torch.nn.Linear(2, 2)
    learner = TorchLearner(module, torch.nn.CrossEntropyLoss(), torch.optim.SGD)
    assert learner.flops_per_token() is None
    module.flops_per_token = lambda: 12.0
    assert learner.flops_per_token() == (12.0, torch.float32)
    bf16 = TorchLearner(module, torch.nn.CrossEntropyLoss(), torch.optim.SGD, precision="bf16")
    assert bf16.flops_per_token() == (12.0, torch.bfloat16)


def test_the_schedule_in_steps_decays_to_min_lr_at_lr_decay_steps_and_stays():
    s = LrSchedule(peak=1e-3, total_steps=2000, kind="cosine", warmup_steps=100, min_lr=1e-4,
                   decay_steps=1500)
    assert s.lr(100) == pytest.approx(1e-3)
    assert s.lr(800) == pytest.approx(1e-4 + 0.9e-3 * (1 + math.cos(math.pi * 0.5)) / 2)
    assert s.lr(1500) == s.lr(1999) == 1e-4
    plain = LrSchedule(peak=1e-3, total_steps=2000, kind="cosine", warmup_steps=100,
                       min_lr=1e-4)
    same = LrSchedule(peak=1e-3, total_steps=2000, kind="cosine", warmup_steps=100,
                      min_lr=1e-4, decay_steps=2000)
    assert [plain.lr(k) for k in range(2000)] == [same.lr(k) for k in range(2000)]
    with pytest.raises(ConfigError, match="lr-decay-steps 100 is not longer than the warmup"):
        LrSchedule(peak=1e-3, total_steps=2000, kind="cosine", warmup_steps=100,
                   decay_steps=100)


def test_the_cli_schedule_counts_warmup_in_steps_with_max_steps():
    from dptrain.learners.build import RunLength, lr_schedule
    from dptrain.learners.config import LearnerConfig

    config = LearnerConfig(schedule="cosine", warmup=100, min_lr=1e-4, lr=1e-3)
    s = lr_schedule(config, 1293, RunLength(batch_size=32, epochs=1, max_steps=2000,
                                            lr_decay_steps=1800))
    assert (s.total_steps, s.warmup_steps, s.decay_steps) == (2000, 100, 1800)
    # without max-steps, warmup stays in schedule-unit (epochs): 100 epochs of 41 steps
    with pytest.raises(ConfigError, match="warmup 100 epochs is as long as the run"):
        lr_schedule(config, 1293, RunLength(batch_size=32, epochs=1))


@pytest.mark.parametrize("flags, message", [
    ({"max_steps": 50, "warmup": 100.0}, "max-steps 50 is not longer than warmup 100 steps"),
    ({"max_steps": 100, "warmup": 100.0}, "max-steps 100 is not longer than warmup 100 steps"),
    ({"lr_decay_steps": 50}, "give max-steps too"),
    ({"max_steps": 500, "warmup": 100.0, "lr_decay_steps": 80},
     "lr-decay-steps 80 is not longer than warmup 100"),
    ({"val_every": -1}, "val-every: expected an integer >= 1, or 0 to leave it unset"),
    ({"peak_flops": -1.0}, "peak-flops: expected FLOP/s > 0"),
])
def test_inconsistent_steps_are_one_line(flags, message):
    with pytest.raises(ConfigError, match=message) as err:
        TrainOptions(model="torch-mlp", **flags)
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------- the Trainer
def test_max_steps_ends_the_run_mid_epoch_at_exactly_that_step(tmp_path):
    summary = _fit(tmp_path, max_steps=50, epochs=1)  # epochs are not what ends it
    assert summary["steps"] == 50 and summary["final_epoch"] == 2
    assert summary["epochs_done"] == pytest.approx(50 / PER_EPOCH)
    assert summary["samples_seen"] == 1293 + 9 * BATCH
    assert [p.name for p in ckpt.list_steps(tmp_path / "checkpoints")] == \
        ["step-00000050", "step-00000041"]
    meta = json.loads((tmp_path / "checkpoints/step-00000050/meta.json").read_text())
    assert meta["epoch_done"] is False  # the run may go on from here with a larger max-steps
    epochs = _rows(tmp_path / "epochs.csv")
    assert [(r["epoch"], r["step"]) for r in epochs] == [("1", "41"), ("2", "50")]
    # validated at each epoch end and at the last step: steps.csv's rows
    steps = _rows(tmp_path / "steps.csv")
    assert [r["step"] for r in steps] == ["41", "50"]
    assert steps[-1]["val_error"] == epochs[-1]["val_error"]
    # a run resumed from its last checkpoint has nothing left to do
    again = _fit(tmp_path, max_steps=50)
    assert again["resumed_from"].endswith("step-00000050")
    assert again["params_sha256"] == summary["params_sha256"]


def test_validation_points_choose_best_and_write_steps_csv(tmp_path):
    summary = _fit(tmp_path, max_steps=50, val_every=20, val_batches=2, keep_last=10)
    rows = _rows(tmp_path / "steps.csv")
    assert [int(r["step"]) for r in rows] == [20, 40, 50]  # and the run's end
    assert [int(r["samples"]) for r in rows] == [640, 1280, 1581]
    assert {"epoch", "lr", "train_loss", "train_error", "val_loss", "val_error"} <= set(rows[0])
    # train columns: the steps since the previous point (steps 41-50 here, not epoch 2's)
    assert float(rows[2]["train_loss"]) != float(rows[1]["train_loss"])
    errors = [float(r["val_error"]) for r in rows]
    best = min(range(3), key=lambda i: (errors[i], i))
    assert summary["best_step"] == int(rows[best]["step"])
    assert summary["val_error"] == errors[-1] and summary["best_val_error"] == errors[best]
    best_meta = json.loads((tmp_path / "checkpoints/best/meta.json").read_text())
    assert best_meta["step"] == summary["best_step"]
    # every point wrote a checkpoint (the epoch end at 41 too)
    assert sorted(int(p.name[5:]) for p in ckpt.list_steps(tmp_path / "checkpoints")) == \
        [20, 40, 41, 50]
    # the epoch rows hold train metrics; the last one the last point's and the test part's
    epochs = _rows(tmp_path / "epochs.csv")
    assert epochs[0]["val_error"] == "" and float(epochs[1]["val_error"]) == errors[-1]
    assert epochs[1]["test_error"] != ""


def test_val_batches_validate_on_the_same_chosen_samples_every_time(tmp_path):
    """The rows' validation is that of the chosen 64 samples: evaluating them by hand with
    best/'s model gives best/'s row; all 144 give another number."""
    _fit(tmp_path, max_steps=30, val_every=10, val_batches=2)
    rows = _rows(tmp_path / "steps.csv")
    best = json.loads((tmp_path / "checkpoints/best/meta.json").read_text())["step"]
    row = next(r for r in rows if int(r["step"]) == best)
    learner = _learner()
    learner.setup(init_distributed())
    state = ckpt.validate(tmp_path / "checkpoints/best").load_state()
    learner.load_checkpoint(state["learner"], tmp_path / "checkpoints/best")
    chosen = validation_indices(144, batches=2, batch_size=BATCH, seed=0)
    x, y = SPLIT.validation[chosen]
    wrong, count = learner.eval_step((x, y))["error"]
    assert float(row["val_error"]) == pytest.approx(wrong / count)
    x, y = SPLIT.validation[torch.arange(144)]
    wrong_all, count_all = learner.eval_step((x, y))["error"]
    assert count_all == 144 and count == 64


def test_patience_counts_validation_points(tmp_path):
    summary = _fit(tmp_path, max_steps=400, val_every=5, val_batches=1, patience=1,
                   monitor="val_loss")
    rows = _rows(tmp_path / "steps.csv")
    losses = [float(r["val_loss"]) for r in rows]
    assert summary["stopped_early"] and summary["steps"] < 400
    assert losses[-1] >= losses[-2]  # it stopped at the first point that did not improve
    assert all(b < a for a, b in zip(losses[:-2], losses[1:-1]))
    assert summary["steps"] == int(rows[-1]["step"]) and summary["steps"] % 5 == 0


def _crashed_then_resumed(out: Path, crash_at: int, **config) -> dict:
    with pytest.raises(Crash):
        _fit(out, _learner(crash_at), **config)
    return _fit(out, **config)


def test_a_run_that_crashes_resumes_to_the_unbroken_runs_end_and_steps_csv(tmp_path):
    config = {"max_steps": 60, "val_every": 10, "val_batches": 2, "checkpoint_every": 3,
              "keep_last": 100}
    whole = _fit(tmp_path / "whole", **config)
    # step 17: resumes from step 15's checkpoint, 5 steps after the point of step 10 (their
    # train sums come back); step 45: just after the epoch end (41) and the point at 40
    for crash_at in (17, 45):
        out = tmp_path / f"crash{crash_at}"
        resumed = _crashed_then_resumed(out, crash_at, **config)
        assert resumed["resumed_from"]
        assert resumed["params_sha256"] == whole["params_sha256"]
        for name in ("steps.csv", "epochs.csv"):
            assert (out / name).read_text() == (tmp_path / "whole" / name).read_text(), name
        assert resumed["best_step"] == whole["best_step"]
        best = ckpt.validate(out / "checkpoints/best").load_state()["learner"]
        whole_best = ckpt.validate(tmp_path / "whole/checkpoints/best").load_state()["learner"]
        assert all(torch.equal(best["model"][k], whole_best["model"][k])
                   for k in whole_best["model"])


# --------------------------------------------------------------------------- token data
def _token_split() -> Split:
    """Digits dressed as token data: a vocabulary and one target position per sample (the
    torch learner's integer windows come with the token datasets)."""
    return Split(name="digits-as-tokens", task="classification", num_classes=10,
                 train=SPLIT.train, validation=SPLIT.validation, test=SPLIT.test,
                 vocabulary=Vocabulary.from_text("0123456789"),
                 unknown_tokens={"validation": 2, "test": 0})


def metric_extras(split: Split):
    """The language models' report extras, for windows of one position."""
    return dataclasses.replace(language_report(DataSpec.of(split)), positions_per_sample=1)


def test_token_data_report_perplexity_bits_tokens_per_second_and_mfu(tmp_path):
    learner = _learner()
    learner.module.flops_per_token = lambda: 1.0e4
    split = _token_split()
    summary = _fit(tmp_path, learner, split, metric_extras(split), max_steps=12, val_every=6,
                   peak_flops=1e9)
    assert not (tmp_path / FILE_NAME).exists()  # the caller's to write (dptrain.train.job)
    assert summary["vocabulary"] == {"kind": "char", "size": 11, "file": FILE_NAME}
    assert summary["unknown_tokens"] == {"validation": 2, "test": 0}
    assert summary["monitor"] == "val_loss"  # token data: the loss chooses
    for part in ("val", "test"):
        assert summary[f"{part}_perplexity"] == pytest.approx(math.exp(summary[f"{part}_loss"]))
        assert summary[f"{part}_bits_per_character"] == \
            pytest.approx(summary[f"{part}_loss"] / math.log(2))
    assert summary["tokens_seen"] == 12 * BATCH  # one position per sample
    assert summary["tokens_per_s"] == pytest.approx(12 * BATCH / summary["train_time_s"])
    assert (summary["peak_flops"], summary["peak_flops_source"]) == (1e9, "--peak-flops")
    assert summary["mfu"] == pytest.approx(1.0e4 * summary["tokens_per_s"] / 1e9)
    rows = _rows(tmp_path / "steps.csv")
    assert [r["tokens"] for r in rows] == ["192", "384"]
    assert "val_bits_per_character" in rows[0]


def test_the_peak_is_measured_on_this_cpu_when_not_given(tmp_path):
    learner = _learner()
    learner.module.flops_per_token = 5.0e3  # a number does too
    summary = _fit(tmp_path, learner, _token_split(), metric_extras(_token_split()), max_steps=3)
    assert summary["peak_flops"] > 1e6 and summary["peak_flops_source"].startswith("measured")
    assert 0 < summary["mfu"] < 1


def test_data_without_a_vocabulary_report_no_token_metrics(tmp_path):
    summary = _fit(tmp_path, max_steps=3)
    assert not {"tokens_per_s", "mfu", "vocabulary", "val_perplexity"} & set(summary)
    assert not (tmp_path / FILE_NAME).exists()


def test_the_trainer_adds_only_the_extras_it_is_given(tmp_path):
    """The Trainer knows no model family: token data without extras report as any data, and
    extras report on any data."""
    learner = _learner()
    learner.module.flops_per_token = lambda: 1.0e4
    plain = _fit(tmp_path / "plain", learner, _token_split(), max_steps=3)
    assert not {"tokens_per_s", "tokens_seen", "mfu", "vocabulary", "val_perplexity"} & \
        set(plain)
    assert plain["monitor"] == "val_error"  # the task's: nobody said the loss chooses
    extras = MetricExtras(derive=per_position_figures("pixel"), positions_per_sample=4,
                          monitor="loss",
                          summary={"source": "digits"})
    summary = _fit(tmp_path / "extras", split=SPLIT, extras=extras, max_steps=3, val_every=3)
    assert summary["source"] == "digits" and summary["monitor"] == "val_loss"
    assert summary["tokens_seen"] == 3 * BATCH * 4
    assert summary["val_bits_per_pixel"] == pytest.approx(summary["val_loss"] / math.log(2))
    assert "mfu" not in summary  # the model declares no FLOPs
    assert [r["tokens"] for r in _rows(tmp_path / "extras" / "steps.csv")] == [str(3 * BATCH * 4)]


def test_extras_name_a_bare_monitor_and_whole_positions():
    with pytest.raises(ConfigError, match="val_loss"):
        MetricExtras(monitor="val_loss")
    with pytest.raises(ConfigError, match="positions_per_sample"):
        MetricExtras(positions_per_sample=0)
