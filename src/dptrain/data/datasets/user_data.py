"""Your own dataset for `dptrain train --dataset PATH.py:FUNCTION` (and the library's Trainer).

    # my_data.py
    import torch
    from dptrain.data import Split

    class Squares(torch.utils.data.Dataset):
        def __init__(self, n): self.x = torch.linspace(-1, 1, n)[:, None]
        def __len__(self): return len(self.x)
        def __getitem__(self, i): return self.x[i], self.x[i] ** 2   # (input, target)

    def squares():
        return Split(name="squares", task="regression", num_classes=None,
                     train=Squares(200), test=Squares(50))

The contract: `FUNCTION()` takes no argument and returns a `dptrain.data.Split` whose `train`
and `test` (and, optionally, `validation`: the part that picks the best epoch; without one,
`--val-size` of `train` is held out for it) are map-style datasets (`__len__`, and `dataset[i]` -> `(x, y)` with `x` a float
tensor, the same shape for every sample, as the network should see it); `task` is
"classification" (then `num_classes` K and each `y` a class id in [0, K), int or 0-d int64
tensor) or "regression" (`num_classes` None and each `y` a float tensor of the targets).
Samples are read one at a time, in DataLoader workers with `--workers N`, so a dataset may read
its files lazily; keep what it holds in memory small. The file's sha256 joins the run's record,
so a resumed run refuses a changed file.
"""

from __future__ import annotations

import torch

from dptrain.data.datasets.base import IGNORE_INDEX, Split
from dptrain.errors import ConfigError, DataError
from dptrain.user_code import load_function


def load_user_dataset(spec: str) -> Split:
    """The split `FUNCTION()` of `PATH.py:FUNCTION` returns, its first samples checked."""
    fn = load_function(spec, option="--dataset", what="dataset file")
    try:
        split = fn()
    except (ConfigError, DataError):
        raise
    except Exception as err:  # the user's code: name it and what it raised
        raise DataError(f"--dataset {spec}: {type(err).__name__} while building the dataset: "
                        f"{err}") from None
    if not isinstance(split, Split):
        raise ConfigError(f"--dataset {spec}: returned a {type(split).__name__}; expected a "
                          f"dptrain.data.Split (see dptrain.data.datasets.user_data)")
    for part in ("train", "validation", "test"):
        if getattr(split, part) is not None:
            _check_sample(spec, part, getattr(split, part), split)
    return split


def _check_sample(spec: str, part: str, dataset: torch.utils.data.Dataset, split: Split) -> None:
    where = f"--dataset {spec}: {part}[0]"
    if len(dataset) < 1:
        raise DataError(f"--dataset {spec}: the {part} part has no samples")
    try:
        x, y = dataset[0]
    except Exception as err:  # the user's code
        raise DataError(f"{where}: {type(err).__name__}: {err} (items must be (x, y))") from None
    if not isinstance(x, torch.Tensor) or x.dtype == torch.bool or x.is_complex():
        raise DataError(f"{where}: the input must be a float tensor (or integer ids, e.g. "
                        f"tokens for an nn.Embedding), got {type(x).__name__}"
                        f"{'' if not isinstance(x, torch.Tensor) else f' of {x.dtype}'}")
    y = torch.as_tensor(y)
    if split.task == "classification":
        # One class id per sample, or one per position (a language model's next tokens);
        # IGNORE_INDEX marks a padded position.
        ids = y[y != IGNORE_INDEX] if not y.is_floating_point() else y
        in_range = not ids.numel() or (0 <= int(ids.min()) and int(ids.max()) < split.num_classes)
        if y.is_floating_point() or y.dim() > 1 or not in_range:
            raise DataError(f"{where}: a classification target must be a class id in "
                            f"[0, {split.num_classes}) or a vector of them (one per position), "
                            f"got {y!r}")
    elif not y.is_floating_point():
        raise DataError(f"{where}: a regression target must be a float tensor, got {y.dtype}")
