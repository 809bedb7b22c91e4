"""What was tried to bring tagi-gpt's loss nearer torch-gpt's: σ_v, a process noise on the
parameters' variances, and tempered updates, each a run of a small tagi-gpt on the same text.

    .venv/bin/python bench/language_models/tagi_gpt_variants.py  # writes bench/results/tagi_gpt_variants.json

The network is the registry's tagi-gpt (`dptrain.models.tagi_gpt`: softmax attention
weights, RoPE, RMSNorm) at width 64, 2 blocks, 4 heads, context 64, on the tiny Shakespeare
text of bench/language_models/tagi_gpt.py (characters, the last 10 % validated), 12 windows a step, 2000 steps,
seed 0. Each variant changes one thing about the step a TAGI learner takes:

- `sigma_v`: the observation noise of the hierarchical softmax's ±1 observations;
- `process_noise` q: after each step every parameter's variance grows by q, as a random walk
  of the parameters would (a Kalman filter's process noise): it keeps the 768 observations of
  each step (12 windows × 64 positions, one update) from shrinking the variances for good;
- `delta_scale` c: the step's deltas of the means and variances times c < 1, a tempered
  update (each observation counted as c of one).

Scored every 500 steps on the same 16 fixed validation batches (12,288 tokens): the loss in
nats per token and the error under the hierarchical softmax's mean and probit links (the
lower loss counts, as `--hrc-link auto` would pick it on validation), and the ECE (15 bins) of
that link. torch-gpt of the same size (nanoGPT's recipe, `dptrain train`, its own 40
validation batches) is the reference. Two variants run at a time, one thread each.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from dptrain.models import ModelOptions, tagi_gpt
from dptrain.learners.tagi_learner import encode_positions
from dptrain.tagi import HRCSoftmax, OutputUpdater, manual_seed

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `common`
from common import RESULTS, command_line, cpu_model, gpt_runs  # noqa: E402

DEFAULT_OUTPUT = RESULTS / "tagi_gpt_variants.json"
WIDTH, LAYERS, HEADS, CONTEXT, BATCH = 64, 2, 4, 64, 12
VAL_BATCHES, BINS = 16, 15


@dataclass(frozen=True)
class Variant:
    sigma_v: float
    process_noise: float = 0.0
    delta_scale: float = 1.0

    @property
    def name(self) -> str:
        parts = [f"σ_v {self.sigma_v:g}"]
        if self.process_noise:
            parts.append(f"process noise {self.process_noise:g}")
        if self.delta_scale != 1.0:
            parts.append(f"deltas × {self.delta_scale:g}")
        return ", ".join(parts)


VARIANTS = [Variant(4.0), Variant(1.0), Variant(2.0), Variant(8.0),
            Variant(4.0, process_noise=1e-5), Variant(4.0, process_noise=1e-4),
            Variant(1.0, process_noise=1e-4), Variant(4.0, delta_scale=0.3),
            Variant(8.0, delta_scale=0.3)]


def _tokens(text: Path) -> tuple[torch.Tensor, torch.Tensor, int]:
    chars = text.read_text(encoding="utf-8")
    vocabulary = {c: i for i, c in enumerate(sorted(set(chars)))}
    ids = torch.tensor([vocabulary[c] for c in chars])
    cut = int(0.9 * len(ids))
    return ids[:cut], ids[cut:], len(vocabulary)


def _windows(ids: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(ids) - CONTEXT - 1, (BATCH,), generator=generator)
    w = torch.stack([ids[s:s + CONTEXT + 1] for s in starts])
    return w[:, :-1], w[:, 1:]


def _score(net, hrc_links: dict[str, HRCSoftmax], val: torch.Tensor) -> dict[str, float]:
    """Loss and error under each link on the fixed validation batches; the better link's ECE."""
    net.eval()
    generator = torch.Generator().manual_seed(1)
    probs = {link: [] for link in hrc_links}
    targets = []
    with torch.no_grad():
        for _ in range(VAL_BATCHES):
            x, y = _windows(val, generator)
            mu, var = net(x)
            rows = (x.numel(), -1)
            for link, hrc in hrc_links.items():
                p = hrc.probabilities(mu.reshape(rows), var.reshape(rows))
                probs[link].append(p / p.sum(1, keepdim=True))
            targets.append(y.reshape(-1))
    net.train()
    y = torch.cat(targets)
    scores = {}
    for link, parts in probs.items():
        p = torch.cat(parts)
        confidence, predicted = p.max(1)
        correct = (predicted == y).double()
        bins = (confidence * BINS).long().clamp_max(BINS - 1)
        gaps = torch.zeros(BINS, dtype=torch.float64).index_add_(
            0, bins, correct - confidence.double())
        scores[link] = {"loss": -p.gather(1, y[:, None]).clamp_min(1e-12).log().mean().item(),
                        "error": 1 - correct.mean().item(),
                        "ece": (gaps.abs().sum() / len(y)).item()}
    link = min(scores, key=lambda k: scores[k]["loss"])
    return {**scores[link], "link": link, "other_link_loss": scores[
        next(k for k in scores if k != link)]["loss"]}


def run_variant(variant: Variant, text: Path, steps: int, every: int) -> dict:
    torch.set_num_threads(1)
    train, val, vocab = _tokens(text)
    hrc_links = {link: HRCSoftmax(vocab, link=link) for link in ("mean", "probit")}
    manual_seed(0)
    net = tagi_gpt((CONTEXT,), hrc_links["mean"].num_outputs,
                   ModelOptions(width=WIDTH, layers=LAYERS, heads=HEADS, vocab_size=vocab))
    updater, generator = OutputUpdater(), torch.Generator().manual_seed(0)
    curve = []
    for step in range(1, steps + 1):
        x, y = _windows(train, generator)
        mu, _ = net(x)
        obs, idx = encode_positions(hrc_links["mean"], y, mu.dtype)
        updater.update_using_indices(net.output_z_buffer, obs, variant.sigma_v ** 2, idx,
                                     net.input_delta_z_buffer)
        net.backward()
        if variant.delta_scale != 1.0:
            net.flat_deltas.mul_(variant.delta_scale)
        net.step()
        if variant.process_noise:
            net.flat_params[1].add_(variant.process_noise)
        if step % every == 0 or step == steps:
            curve.append({"step": step, **_score(net, hrc_links, val)})
            print(f"{variant.name}: step {step}: {curve[-1]}", flush=True)
    return {"variant": variant.name, **variant.__dict__, "curve": curve, **curve[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=int, default=500)
    parser.add_argument("--quick", action="store_true", help="20 steps, no JSON")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.every = 20, 10
    text = gpt_runs.shakespeare()
    reference = argparse.Namespace(steps=args.steps, width=WIDTH, layers=LAYERS, heads=HEADS,
                                   block_size=CONTEXT, batch_size=BATCH, val_batches=40,
                                   sigma_v=None, seed=0, threads=2)
    with tempfile.TemporaryDirectory(prefix="tagi-gpt-variants-") as tmp:
        torch_gpt = gpt_runs.train("torch-gpt", text, reference, 1, Path(tmp) / "torch-gpt")
    with ProcessPoolExecutor(2) as pool:
        runs = list(pool.map(run_variant, VARIANTS, [text] * len(VARIANTS),
                             [args.steps] * len(VARIANTS), [args.every] * len(VARIANTS)))
    best = min(runs, key=lambda r: r["loss"])
    print(f"torch-gpt {torch_gpt['val_loss']:.3f} nats per token, ECE {torch_gpt['val_ece']:.3f};"
          f" the best tagi-gpt variant ({best['variant']}) {best['loss']:.3f}, ECE "
          f"{best['ece']:.3f}")
    if not args.quick:
        args.output.write_text(json.dumps({
            "benchmark": "tagi_gpt_variants", "command": command_line(("NANOGPT_DIR",)),
            "machine": {"cpu": cpu_model(), "cores": os.cpu_count(),
                        "python": platform.python_version(), "torch": torch.__version__},
            "config": {"width": WIDTH, "layers": LAYERS, "heads": HEADS, "context": CONTEXT,
                       "batch_size": BATCH, "steps": args.steps, "val_batches": VAL_BATCHES},
            "torch_gpt": torch_gpt, "runs": runs}, indent=1) + "\n")
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
