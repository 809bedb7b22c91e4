"""`dptrain export` of a torch-gpt run: token ids (batch, seq) in with the sequence length
dynamic up to the context, logits per position out, equal to the eager model at two lengths."""

from __future__ import annotations

import json

import pytest
import torch

from dptrain.cli.main import main
from dptrain.errors import ConfigError
from dptrain.export import export_run, load_exported, predict_exported
from dptrain.inference import load_run

pytestmark = pytest.mark.e2e

TEXT = "to be, or not to be: that is the question.\n" * 12


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_export")
    text = root / "tiny.txt"
    text.write_text(TEXT, encoding="utf-8")
    out = root / "gpt"
    assert main(["train", "--model", "torch-gpt", "--dataset", f"text:{text}",
                 "--block-size", "8", "--layers", "1", "--heads", "2", "--width", "16",
                 "--batch-size", "4", "--max-steps", "4", "--warmup", "1", "--val-every", "4",
                 "--val-batches", "1", "--nproc", "1", "--no-progress", "--out",
                 str(out)]) == 0
    return out


@pytest.mark.parametrize("fmt", ["pt2", "onnx"])
def test_the_gpt_exports_with_a_dynamic_sequence_length_and_matches_eager(gpt_run, tmp_path,
                                                                           fmt):
    written = export_run(gpt_run, fmt, tmp_path / f"gpt.{fmt}")
    meta = json.loads((tmp_path / f"gpt.{fmt}.json").read_text())
    assert meta["outputs"] == ["logits"] and meta["inputs"]["x"]["dtype"] == "int64"
    assert meta["inputs"]["x"]["max_seq"] == 8 and meta["vocabulary"]["kind"] == "char"
    assert {"logits_max_abs_diff_b7x8", "logits_max_abs_diff_b7x5"} <= set(written.metadata[
        "checked"])
    exported = load_exported(written.path)
    model = load_run(gpt_run).model.eval()
    vocab = load_run(gpt_run).vocabulary
    ids = vocab.encode(TEXT[:8 * 3], where="test").view(3, 8)
    for length in (8, 3):  # neither is the other's shape: the length is not baked in
        got = exported(ids[:, :length])["logits"]
        with torch.no_grad():
            want = model(ids[:, :length])
        assert got.shape == (3, length, vocab.size)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ConfigError, match="a language model's export gives logits per "
                                          "position"):
        predict_exported(written.path)


def test_the_command_line_says_it_checked_two_sequence_lengths(gpt_run, tmp_path, capsys):
    assert main(["export", str(gpt_run), "--format", "pt2", "--out",
                 str(tmp_path / "gpt.pt2")]) == 0
    said = capsys.readouterr().out
    assert "outputs logits); checked against the live model at batch sizes 1 and 7 at two " \
           "sequence lengths each: logits_max_abs_diff_b1x8" in said, said
    assert "logits_max_abs_diff_b7x5" in said
