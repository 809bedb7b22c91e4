"""`dptrain generate RUN` as a user runs it: text on stdout, the same for the same seed, a bad
prompt refused in one line."""

from __future__ import annotations

import pytest

from dptrain.cli.main import main
from tests._cli import dptrain_cmd, run

pytestmark = pytest.mark.e2e

TEXT = "to be, or not to be: that is the question.\n" * 12


def test_generate_prints_the_same_text_for_a_seed_and_refuses_a_bad_prompt(tmp_path):
    text = tmp_path / "tiny.txt"
    text.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "gpt"
    assert main(["train", "--model", "torch-gpt", "--dataset", f"text:{text}",
                 "--block-size", "8", "--layers", "1", "--heads", "2", "--width", "16",
                 "--batch-size", "4", "--max-steps", "4", "--warmup", "1", "--val-every", "4",
                 "--val-batches", "1", "--nproc", "1", "--no-progress", "--out",
                 str(out)]) == 0
    args = ["generate", str(out), "--prompt", "to be", "--max-new-tokens", "30",
            "--temperature", "0.8", "--top-k", "5", "--seed", "7"]
    first = run(dptrain_cmd(*args), timeout_s=120)
    assert first.returncode == 0, first.output
    assert first.stdout.startswith("to be") and len(first.stdout) == len("to be") + 30 + 1
    assert run(dptrain_cmd(*args), timeout_s=120).stdout == first.stdout

    bad = run(dptrain_cmd("generate", str(out), "--prompt", "to BE"), timeout_s=120)
    assert bad.returncode != 0 and bad.stdout == ""
    assert bad.stderr == ("dptrain generate: error: --prompt: the character 'B' at position 3 "
                          "is not in the run's vocabulary of 17 characters\n")

    table = run(dptrain_cmd("predict", str(out), "--out", str(tmp_path / "p.csv")),
                timeout_s=120)
    assert table.returncode == 2 and len(table.stderr.splitlines()) == 1
    assert "torch-gpt is a language model" in table.stderr and "dptrain generate" in table.stderr
