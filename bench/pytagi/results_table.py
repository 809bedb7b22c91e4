"""Print a benchmark result file as the Markdown shown in bench/README.md, with its machine line.

    .venv/bin/python bench/pytagi/results_table.py bench/results/tagi_vs_pytagi.json

The tables in the README are pasted from this output, so they say which run, machine and load
they come from. Only the tagi_vs_pytagi result files have a table here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def machine_line(record: dict) -> str:
    hw, sw = record.get("hardware", {}), record.get("software", {})
    load = record.get("load_average_1_5_15", {})
    before, after = load.get("before", [None])[0], load.get("after", [None])[0]
    env = {k: v for k, v in record.get("environment", {}).items() if v is not None}
    parts = [f"{hw.get('cpu_model', '?')}, {hw.get('usable_cores', '?')} cores, "
             f"{hw.get('memory_gib', '?')} GiB",
             f"python {sw.get('python', '?')}, torch {sw.get('torch', '?')}"
             + (f", pytagi {sw['pytagi']}" if "pytagi" in sw else ""),
             f"git {record.get('git', '?')}, {record.get('date_utc', '?')}"]
    if before is not None and after is not None:
        parts.append(f"1-minute load average {before:.1f} before, {after:.1f} after")
    parts.append(", ".join(f"{k}={v}" for k, v in env.items()) or "default environment")
    return "; ".join(parts)


def _rate(samples_per_s: float) -> str:
    return f"{samples_per_s:,.0f}" if samples_per_s >= 100 else f"{samples_per_s:.2f}"


def tagi_vs_pytagi_table(record: dict) -> str:
    # FNN runs carry the matmul fraction (our GFLOP/s over torch's on the same products).
    matmul = "matmul_fraction" in record["results"][0]
    rows = ["| phase | batch | dptrain.tagi | pytagi | ratio | target | best |"
            + (" GFLOP/s | matmul GFLOP/s | fraction | target |" if matmul else ""),
            "|---|---:|---:|---:|---:|---|---:|" + ("---:|---:|---:|---|" if matmul else "")]
    for r in record["results"]:
        verdict = "met" if r["meets_target"] else "missed"
        row = (f"| {r['phase']} | {r['batch_size']} | {_rate(r['ours_samples_per_s'])} | "
               f"{_rate(r['pytagi_samples_per_s'])} | {r['ratio']:.1f}x | "
               f"≥{r['target_ratio']:g}x {verdict} | {r['ratio_of_best']:.1f}x |")
        if matmul:
            goal = r["matmul_fraction_target"]
            goal = "" if goal is None else (
                f"≥{goal:.0%} " + ("met" if r["meets_matmul_target"] else "missed"))
            row += (f" {r['ours_gflops']:.1f} | {r['matmul_gflops']:.1f} | "
                    f"{r['matmul_fraction']:.0%} | {goal} |")
        rows.append(row)
    return "\n".join(rows)


def main(paths: list[str]) -> None:
    for path in paths:
        record = json.loads(Path(path).read_text())
        if record.get("benchmark") != "tagi_vs_pytagi":
            print(f"{path}: no table for benchmark {record.get('benchmark')!r}")
            continue
        print(f"{path}: {machine_line(record)}\n")
        print(tagi_vs_pytagi_table(record) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:] or ["bench/results/tagi_vs_pytagi.json"])
