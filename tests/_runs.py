"""Comparing the parameters of runs."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from dptrain.inference import load_run


def relative_gap(ours: Mapping[str, torch.Tensor], theirs: Mapping[str, torch.Tensor]) -> float:
    """The largest difference between two state dicts, tensor by tensor, relative to each
    tensor's largest magnitude in `theirs`."""
    assert ours.keys() == theirs.keys()
    return max(((ours[k].double() - theirs[k].double()).abs().max()
                / theirs[k].double().abs().max()).item() for k in theirs)


def max_relative_difference(run_dir: Path, reference: Path) -> float:
    """`relative_gap` of the last parameters of two `dptrain train` run directories."""
    return relative_gap(load_run(run_dir, which="last").model.state_dict(),
                        load_run(reference, which="last").model.state_dict())
