"""`dptrain generate RUN_DIR --prompt TEXT`: text sampled from a trained language model."""

from __future__ import annotations

import argparse
import sys

from dptrain.inference import load_run


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate", help="sample text from a trained language model (one process)",
        description="Load the best (or last) checkpoint of a language-model run (--model "
                    "torch-gpt on text:PATH or tokens:DIR), continue the prompt by sampling "
                    "one token at a time, and print the prompt and its continuation. The same "
                    "--seed gives the same text; --temperature 0 takes the most likely token "
                    "every time.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of a dptrain train run")
    p.add_argument("--prompt", default="",
                   help="the text to continue, in the run's vocabulary; longer than the "
                        "context, its last block is kept (default: empty, which starts from "
                        "a newline)")
    p.add_argument("--max-new-tokens", type=int, default=200, metavar="N",
                   help="tokens to sample after the prompt (default: 200)")
    p.add_argument("--temperature", type=float, default=1.0, metavar="T",
                   help="divides the logits: below 1 more likely tokens, above 1 more varied, "
                        "0 the most likely (default: 1.0)")
    p.add_argument("--top-k", type=int, default=None, metavar="K",
                   help="sample among the K most likely tokens only (default: all)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the draws: the same seed, the same text (default: 0)")
    p.add_argument("--checkpoint", choices=("best", "last"), default="best",
                   help="best: the checkpoint validation chose; last: the newest (default: best)")
    p.set_defaults(func=generate_command)


def generate_command(args: argparse.Namespace) -> int:
    run = load_run(args.run_dir, which=args.checkpoint)
    for note in run.notes:
        print(f"dptrain generate: {note}", file=sys.stderr)
    text = run.generate(args.prompt, max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                        report=lambda note: print(f"dptrain generate: {note}", file=sys.stderr))
    print(text)
    return 0
