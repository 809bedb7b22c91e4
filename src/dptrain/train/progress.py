"""Rank 0's progress bar: samples/s over all ranks (with positions per sample, as a language
model's tokens: tokens/s and MFU) and this rank's running metrics."""

from __future__ import annotations

import sys

from dptrain.learners.protocol import Metrics


class Progress:
    def __init__(self, *, total: int, done: int, desc: str, enabled: bool,
                 positions_per_sample: int | None = None,
                 mfu_per_position: float | None = None) -> None:
        self.bar = None
        self.positions_per_sample = positions_per_sample
        self.mfu_per_position = mfu_per_position
        self.sums: dict[str, list[float]] = {}
        self.samples = 0
        if enabled:
            from tqdm import tqdm

            # Redrawn at most every half second: on a pipe (CI, a log file) every redraw is a line.
            self.bar = tqdm(total=total, initial=done, desc=desc, unit="step", leave=False,
                            file=sys.stderr, mininterval=0.5, dynamic_ncols=True)

    def update(self, global_samples: int, metrics: Metrics) -> None:
        if self.bar is None:
            return
        for name, (s, c) in metrics.items():
            total = self.sums.setdefault(name, [0.0, 0.0])
            total[0] += s
            total[1] += c
        self.bar.update(1)
        elapsed = self.bar.format_dict["elapsed"] or 1e-9
        self.samples += global_samples
        # a name starting with "_" is the learner's own bookkeeping (Learner.end_training)
        shown = {k: f"{s / c:.4g}" for k, (s, c) in self.sums.items()
                 if c and not k.startswith("_")}
        rates = {"samples_per_s": f"{self.samples / elapsed:.0f}"}
        if self.positions_per_sample is not None:  # shown as summary.json names them
            per_s = self.samples * self.positions_per_sample / elapsed
            rates["tokens_per_s"] = f"{per_s:.0f}"
            if self.mfu_per_position is not None:
                rates["mfu"] = f"{100 * self.mfu_per_position * per_s:.1f}%"
        self.bar.set_postfix(**rates, **shown, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
