"""bench/README.md's pruning figures are those of bench/results/tune_pruning.json (rerun the
script to change them, never edit them by hand)."""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_pruning_figures_are_the_result_file():
    r = json.loads((REPO / "bench" / "results" / "tune_pruning.json").read_text())
    text = " ".join((REPO / "bench" / "README.md").read_text().split())
    reach = r["to_reach_level"]
    for quoted in (f"best train_error {r['level']:.4f}",
                   f"after {reach['none']['trials']} trials in both"
                   if reach["none"]["trials"] == reach["halving"]["trials"] else "",
                   f"{r['pruned_trials']} of {r['trials']} trials were pruned",
                   f"spent {reach['halving']['process_hours']:.4f} process-hours to reach it "
                   f"instead of {reach['none']['process_hours']:.4f} "
                   f"(x{r['process_hours_ratio_to_reach']:.2f})",
                   f"x{r['process_hours_ratio_whole_search']:.2f} for the whole search"):
        assert quoted in text, quoted
    assert r["best"]["none"] == r["best"]["halving"] or r["level"] == max(r["best"].values())
