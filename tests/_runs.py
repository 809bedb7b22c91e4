"""Comparing the run directories that `dptrain train` wrote."""

from __future__ import annotations

from pathlib import Path

from dptrain.inference import load_run


def max_relative_difference(run_dir: Path, reference: Path) -> float:
    """The largest difference between the last parameters of two runs, tensor by tensor,
    relative to each tensor's largest magnitude in `reference`."""
    ours = load_run(run_dir, which="last").model.state_dict()
    theirs = load_run(reference, which="last").model.state_dict()
    assert ours.keys() == theirs.keys()
    return max(((ours[k].double() - theirs[k].double()).abs().max()
                / theirs[k].double().abs().max()).item() for k in theirs)
