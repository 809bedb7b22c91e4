"""The benchmark tables of docs/results.md, made from bench/results/*.json at build time.

`render(name)` is what `<!-- generate: results NAME -->` becomes. Each table reads its result
file(s) only; the prose around it cites the same files, and tests/unit/test_readme_figures.py
checks that prose against them.
"""

from __future__ import annotations

import ast
import json
import re
import statistics
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
PHASES = {"train": "train step", "eval": "eval forward"}


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text(encoding="utf-8"))


def rate(samples_per_s: float) -> str:
    """A throughput: thousands separators, two decimals below 100."""
    return f"{samples_per_s:,.0f}" if samples_per_s >= 100 else f"{samples_per_s:.2f}"


def percent(fraction: float, digits: int = 0) -> str:
    return f"{100 * fraction:.{digits}f} %"


def target(value: float, met: bool) -> str:
    return f"≥ {value:g}x " + ("met" if met else "**not met**")


def _lines(header: str, align: str, rows: list[str]) -> str:
    return "\n".join([header, align, *rows])


def _test_constant(path: str, name: str) -> object:
    """A module-level constant of a test file (the figure the test asserts on fresh runs)."""
    tree = ast.parse((REPO / path).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == name:
            return ast.literal_eval(node.value)
    raise LookupError(f"{path} has no constant {name}")


def learning() -> str:
    reference = load("pytagi_digits_reference.json")["networks"]

    def errors(network: str, library: str) -> str:
        wrong = [r["wrong"] for r in reference[network]["per_seed"][library]]
        each = " / ".join(f"{100 * w / 360:.2f}" for w in wrong)
        return f"{each} % (mean {100 * sum(wrong) / 360 / len(wrong):.2f} %)"

    toy = _test_constant("tests/unit/tagi/test_learning.py", "TOY_INSIDE_3SIGMA")
    rows = [f"| digits test error, seeds 0/1/2 | {errors('fnn', 'dptrain')} | "
            f"{errors('fnn', 'pytagi')} |",
            "| digits CNN (Conv2d(1,16,3,padding=1)-ReLU-AvgPool2d(2)-Conv2d(16,32,3,padding=1)-"
            "ReLU-AvgPool2d(2)-Linear(128,64)-ReLU-Linear(64,11), 8x8 images), seeds 0-5 | "
            f"{errors('cnn', 'dptrain')} | {errors('cnn', 'pytagi')} |"]
    rows.append("| toy y = x³ + ε, ±3σ coverage of 200 test points, seeds 0/1/2 | "
                + " / ".join(f"{100 * n / 200:g}" for n in toy) + " % | — |")
    return _lines("| | dptrain.tagi | pytagi 0.2.1 |", "|---|---:|---:|", rows)


def tagi_vs_pytagi() -> str:
    rows = [f"| {PHASES[r['phase']]} | {r['batch_size']} | {rate(r['ours_samples_per_s'])} | "
            f"{rate(r['pytagi_samples_per_s'])} | {r['ratio']:.1f}x | "
            f"{target(r['target_ratio'], r['meets_target'])} | {percent(r['matmul_fraction'])} | "
            + ("|" if r["matmul_fraction_target"] is None else
               f"≥ {percent(r['matmul_fraction_target'])} "
               + ("met |" if r["meets_matmul_target"] else "**not met** |"))
            for r in load("tagi_vs_pytagi.json")["results"]]
    return _lines("| phase | batch | dptrain.tagi samples/s | pytagi samples/s | ratio | target | "
                  "matmul fraction | target |", "|---|---:|---:|---:|---:|---|---:|---|", rows)


def tagi_vs_pytagi_cnn() -> str:
    rows = [f"| {PHASES[r['phase']]} | {r['batch_size']} | {rate(r['ours_samples_per_s'])} | "
            f"{rate(r['pytagi_samples_per_s'])} | {r['ratio']:.1f}x | "
            f"{target(r['target_ratio'], r['meets_target'])} | {r['torch_time_ratio']:.2f}x |"
            for r in load("tagi_vs_pytagi_cnn.json")["results"]]
    return _lines("| phase | batch | dptrain.tagi samples/s | pytagi samples/s | ratio | target | "
                  "ours/torch SGD time |", "|---|---:|---:|---:|---:|---|---:|", rows)


def tagi_vs_pytagi_resnet18() -> str:
    rows = [f"| {PHASES[r['phase']]} | {r['batch_size']} | {rate(r['ours_samples_per_s'])} | "
            f"{rate(r['pytagi_samples_per_s'])} | {r['ratio']:.1f}x | "
            f"{target(r['target_ratio'], r['meets_target'])} |"
            for r in load("tagi_vs_pytagi_resnet18.json")["results"]]
    return _lines("| phase | batch | dptrain.tagi samples/s | pytagi samples/s | ratio | target |",
                  "|---|---:|---:|---:|---:|---|", rows)


def tagi_conv_vs_torch() -> str:
    record = load("tagi_conv_vs_torch.json")
    names = {"cnn": "MNIST CNN (`tagi-cnn`)", "resnet18": "ResNet18 (`tagi-resnet18`), 32x32x3"}
    rows = []
    for r in record["results"]:
        ratio = r["tagi_step_over_torch_step"]
        verdict = "met" if ratio <= record["target_ratio"] else "**not met**"
        # pytagi's memory is read after fewer steps than ours (its steps are slow): say how many
        after = r.get("pytagi_memory_after_steps")
        pytagi = f"{r['pytagi_peak_rss_mb']:,.0f}" + (
            f" (after {after} step{'s' if after != 1 else ''})" if after else "")
        rows.append(f"| {names[r['network']]} | {r['batch']} | {ratio:.2f}x | "
                    f"≤ {record['target_ratio']:g}x {verdict} | {r['tagi_peak_rss_mb']:,.0f} | "
                    f"{r['torch_peak_rss_mb']:,.0f} | {pytagi} |")
    return _lines("| network | batch | TAGI step / torch SGD step | target | TAGI MB | torch MB | "
                  "pytagi MB |", "|---|---:|---:|---|---:|---:|---:|", rows)


def _versus(name: str) -> str:
    record = load(name)
    rows = []
    for key, label in (("dptrain", "dptrain.tagi"), ("pytagi", "pytagi 0.2.1")):
        s = record["summary"][key]
        rows.append(f"| {label} | {s['rmse']:.4f} | {s['log_likelihood']:.4f} | "
                    f"{percent(s['coverage_2sigma'], 1)} | {rate(s['samples_per_s'])} |")
    return rows


def tagi_heteros_vs_pytagi() -> str:
    return _lines("| | test RMSE | log-likelihood per point | 2σ coverage | train samples/s |",
                  "|---|---:|---:|---:|---:|", _versus("tagi_heteros_vs_pytagi.json"))


def tagi_lstm_vs_pytagi() -> str:
    return _lines("| | test RMSE | log-likelihood per window | 2σ coverage | train samples/s |",
                  "|---|---:|---:|---:|---:|", _versus("tagi_lstm_vs_pytagi.json"))


STABILITY = (("mnist", "tagi_stability.json"), ("cifar", "tagi_stability_cifar.json"),
             ("digits-image", "tagi_stability_digits_image.json"))


def tagi_stability() -> str:
    rows = []
    for dataset, name in STABILITY:
        for label, config in load(name)["datasets"][dataset].items():
            s = config["summary"]
            rows.append(f"| `{dataset}` | {label} | {s['collapsed']} / {s['runs']} | "
                        f"{s['median_test_error_percent']:.1f} |")
    return _lines("| data | configuration | collapsed / runs | median test error % |",
                  "|---|---|---:|---:|", rows)


def tagi_ddp() -> str:
    labels = {"fnn": "FNN 784-128-128-11, 256", "cnn": "MNIST CNN, 128"}
    share = {"fnn": "{:.0f} %", "cnn": "{:.1f} %"}
    rows = []
    for network, r in ((n, load("tagi_ddp.json")["networks"][n]["results"]) for n in labels):
        off, on = r["2 ranks x 1 thread, no overlap"], r["2 ranks x 1 thread, overlap"]
        two = r["1 rank x 2 threads"]["samples_per_s"]
        rows.append(f"| {labels[network]} | {rate(off['samples_per_s'])} samples/s | "
                    f"{off['ratio_vs_1x1']:.2f}x | {off['samples_per_s'] / two:.2f}x | "
                    f"{share[network].format(100 * off['comm_share'])} / "
                    f"{share[network].format(100 * on['comm_share'])} |")
    return _lines("| network, samples per rank | 2 ranks x 1 thread | vs 1 rank x 1 thread | "
                  "vs 1 rank x 2 threads | waiting (overlap off / on) |",
                  "|---|---:|---:|---:|---:|", rows)


def checkpoint_pause() -> str:
    rows = []
    for name, m in load("checkpoint_pause.json")["models"].items():
        sync, background = m["sync"], m["async"]
        model = f"`{name.split()[0]}`" + (", FSDP" if m["strategy"] == "fsdp" else "")
        rows.append(
            f"| {model} | {m['processes']} | {sync['checkpoint_bytes'] / 1e6:.1f} MB | "
            f"~{1000 * m['step_s_estimate']:.0f} ms | {1000 * sync['pause_median_s']:.1f} ms "
            f"(max {1000 * sync['pause_max_s']:.1f}) | {1000 * background['pause_median_s']:.1f}"
            f" ms (max {1000 * background['pause_max_s']:.1f}) | "
            f"{m['ratio_pause_sync_over_async']:.1f}x | "
            f"{sync['epoch_wall_median_s']:.2f} s / {background['epoch_wall_median_s']:.2f} s "
            f"({m['ratio_epoch_sync_over_async']:.2f}x) |")
    return _lines("| model (`--width 16`) | processes | checkpoint | step | pause, synchronous | "
                  "pause, background write | shorter | epoch, sync / background |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|", rows)


def input_pipeline() -> str:
    record = load("input_pipeline.json")
    goal = record["target_ratio"]
    rows = [f"| {r['workers']} | {r['dptrain_images_per_s']:,.0f} | "
            f"{r['baseline_images_per_s']:,.0f} | {r['ratio']:.2f}x | "
            f"≥ {goal:.1f}x {'met' if r['ratio'] >= goal else '**not met**'} | "
            f"{r['dptrain_cpu_ms_per_image']:.2f} / {r['baseline_cpu_ms_per_image']:.2f} ms |"
            for r in record["results"]]
    return _lines("| workers | dptrain images/s | baseline images/s | ratio | target | CPU per image,"
                  " dptrain / baseline |", "|---:|---:|---:|---:|---|---:|", rows)


def demo() -> str:
    """The last lines `make demo` printed in its recorded run, the run directory's time
    replaced by <time> (it names the moment of that run)."""
    lines = [re.sub(r"tagi-mlp-digits-\d{8}-\d{6}", "tagi-mlp-digits-<time>", line)
             for line in load("demo.json")["last_lines"]]
    return "```text\n" + "\n".join(lines) + "\n```"


def large_batch() -> str:
    rows = []
    for name, runs in load("large_batch.json")["results"].items():
        errors = [100 * r["test_error"] for r in runs]
        batch = re.search(r"batch (\d+)", name).group(1)
        (peak,) = {r["peak_lr"] for r in runs}
        rows.append(f"| {name} | {batch} | {peak:g} | {sum(errors) / len(errors):.2f} | "
                    + ", ".join(f"{e:.2f}" for e in errors) + " |")
    return _lines("| run | global batch | peak lr | test error, mean of seeds (%) | each seed (%) |",
                  "|---|---|---|---|---|", rows)


def gpt_vs_nanogpt() -> str:
    result = load("gpt_vs_nanogpt.json")

    def row(name: str, r: dict) -> str:
        return (f"| {name} | {r['nanogpt']['whole_val_loss']:.4f} | "
                f"{r['dptrain']['whole_val_loss']:.4f} | {r['nanogpt']['val_loss']:.4f} | "
                f"{r['dptrain']['val_loss']:.4f} | {1000 * r['nanogpt']['step_s']:.1f} | "
                f"{1000 * r['dptrain']['step_s']:.1f} | {r['dptrain']['tokens_per_s']:,.0f} | "
                + (f"{r['dptrain_2proc']['tokens_per_s']:,.0f} |" if "dptrain_2proc" in r
                   else "|"))

    rows = [row(str(r["seed"]), r) for r in result["runs"]] + [row("mean", result["mean"])]
    return _lines("| seed | nanoGPT, whole validation part | dptrain, whole validation part | "
                  "nanoGPT's own estimate | dptrain's own estimate | nanoGPT ms/step | dptrain "
                  "ms/step | dptrain tokens/s, 1 process | 2 processes |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|", rows)


def tagi_gpt() -> str:
    result = load("tagi_gpt.json")
    runs = result["runs"]
    rows = [f"| {model} | {n} | {runs[f'{model}_{n}proc']['val_loss']:.4f} | "
            f"{runs[f'{model}_{n}proc']['val_ece']:.4f} | "
            f"{percent(runs[f'{model}_{n}proc']['val_error'], 1)} | "
            f"{runs[f'{model}_{n}proc']['tokens_per_s']:,.0f} |"
            for model in ("torch-gpt", "tagi-gpt") for n in (1, 2)]
    return _lines("| model | processes | validation loss (nats/token) | ECE | error | "
                  "tokens/s |", "|---|---:|---:|---:|---:|---:|", rows)


def tagi_gpt_variants() -> str:
    result = load("tagi_gpt_variants.json")
    ref = result["torch_gpt"]

    def curve(run: dict) -> str:
        return " / ".join(f"{point['loss']:.2f}" for point in run["curve"])

    rows = [f"| {r['variant']} | {r['loss']:.3f} ({r['link']}) | {curve(r)} | "
            f"{percent(r['error'], 1)} | {r['ece']:.3f} |" for r in result["runs"]]
    rows.append(f"| torch-gpt, nanoGPT's recipe (reference) | {ref['val_loss']:.3f} | | "
                f"{percent(ref['val_error'], 1)} | {ref['val_ece']:.3f} |")
    return _lines("| tagi-gpt variant | validation loss (link) | every 500 steps | error | ECE |",
                  "|---|---:|---:|---:|---:|", rows)


def tagi_attention_vs_cutagi() -> str:
    result = load("tagi_attention_vs_cutagi.json")
    c, step = result["config"], result["step_s"]
    return _lines("| network | threads | dptrain ms/step | cuTAGI main ms/step | speed-up |",
                  "|---|---:|---:|---:|---:|",
                  [f"| Linear(8, {c['t']}·{c['e']}) → MultiheadAttention({c['e']}, "
                   f"{c['heads']}), batch {c['batch']} | {c['threads']} | "
                   f"{1000 * step['dptrain']:.2f} | {1000 * step['cutagi']:.2f} | "
                   f"{result['speedup']:.2f}x ({target(2, result['target_met'])}) |"])


LOST_NODE_CASES = {"kill": "killed (SIGKILL of its agent and rank)",
                   "partition": "cut off the network (its link down)"}
LOST_NODE_PHASES = ("detected", "rendezvous", "started", "resumed", "next_step")


def node_loss_seconds(record: dict, case: str) -> str:
    """A case's figure: the median seconds to the next step (the slowest in brackets), or what
    the bench waited without one."""
    summary = record["summary"][case]
    if summary["median_s"] is None:
        return f"none within {record['cap_s']:g} s"
    return f"{summary['median_s']:.1f} s (max {summary['max_s']:.1f})"


def node_loss() -> str:
    before, after = load("node_loss.before.json"), load("node_loss.json")
    rows = []
    for case, label in LOST_NODE_CASES.items():
        runs = [r["marks_s"] for r in after["runs"] if r["case"] == case and r["recovered"]]
        marks = " / ".join(f"{statistics.median(r[p] for r in runs):.1f}"
                           for p in LOST_NODE_PHASES)
        rows.append(f"| {label} | {node_loss_seconds(before, case)} | "
                    f"{node_loss_seconds(after, case)} | {marks} |")
    return _lines("| the node, lost | torch's rendezvous defaults | dptrain's | noticed / new "
                  "round / workers up / resumed / next step (s, median) |",
                  "|---|---:|---:|---:|", rows)


TABLES = {f.__name__: f for f in (demo, large_batch, learning, tagi_vs_pytagi, tagi_vs_pytagi_cnn,
                                  tagi_vs_pytagi_resnet18, tagi_conv_vs_torch,
                                  tagi_heteros_vs_pytagi, tagi_lstm_vs_pytagi, tagi_stability,
                                  tagi_ddp, checkpoint_pause, input_pipeline, gpt_vs_nanogpt,
                                  tagi_gpt, tagi_gpt_variants, tagi_attention_vs_cutagi,
                                  node_loss)}


def render(name: str) -> str:
    if name not in TABLES:
        raise ValueError(f"no results table {name!r}; known: {', '.join(TABLES)}")
    return TABLES[name]()
