"""`--init-from RUN` for a torch-gpt run: the new text is encoded with the source's vocabulary
(each id means what it meant to the source), and a character the source never had is refused
in one line naming it and where it is."""

from __future__ import annotations

import pytest
import torch

from dptrain.cli.main import main
from dptrain.data.datasets.vocabulary import Vocabulary
from dptrain.inference import load_run

pytestmark = pytest.mark.e2e

SOURCE_TEXT = "to be, or not to be: that is the question.\n" * 12
NEW_TEXT = "the question is not to be.\n" * 16  # fewer characters: its own vocabulary differs


def _train(out, text, *extra):
    return main(["train", "--model", "torch-gpt", "--dataset", f"text:{text}",
                 "--block-size", "8", "--layers", "1", "--heads", "2", "--width", "16",
                 "--batch-size", "4", "--max-steps", "4", "--warmup", "1", "--val-every", "4",
                 "--val-batches", "1", "--nproc", "1", "--no-progress", "--out", str(out),
                 *extra])


def test_a_gpt_fine_tunes_in_its_sources_vocabulary_and_refuses_a_new_character(tmp_path,
                                                                                 capsys):
    source_text, new_text = tmp_path / "source.txt", tmp_path / "new.txt"
    source_text.write_text(SOURCE_TEXT, encoding="utf-8")
    new_text.write_text(NEW_TEXT, encoding="utf-8")
    assert _train(tmp_path / "source", source_text) == 0
    source_vocab = Vocabulary.load(tmp_path / "source" / "vocabulary.json")
    assert Vocabulary.from_text(NEW_TEXT) != source_vocab

    assert _train(tmp_path / "tuned", new_text, "--init-from", str(tmp_path / "source")) == 0
    said = capsys.readouterr().out
    assert f"init-from {tmp_path / 'source' / 'checkpoints'}" in said, said
    assert Vocabulary.load(tmp_path / "tuned" / "vocabulary.json") == source_vocab
    tuned = load_run(tmp_path / "tuned")
    assert tuned.vocabulary == source_vocab
    source = load_run(tmp_path / "source")
    assert not torch.equal(tuned.model.head.weight, source.model.head.weight)  # it trained
    assert tuned.generate("to be", max_new_tokens=10, seed=1).startswith("to be")

    bad = tmp_path / "bad.txt"
    bad.write_text(NEW_TEXT + "Zounds!\n" + NEW_TEXT, encoding="utf-8")
    assert _train(tmp_path / "refused", bad, "--init-from", str(tmp_path / "source")) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'Z'" in err[0] and f"{len(NEW_TEXT)}" in err[0], err
    assert not (tmp_path / "refused" / "checkpoints").exists()

    # a search over the fine-tuning: every trial starts from the source, in its vocabulary
    assert main(["tune", "--model", "torch-gpt", "--dataset", f"text:{new_text}",
                 "--block-size", "8", "--layers", "1", "--heads", "2", "--width", "16",
                 "--batch-size", "4", "--max-steps", "4", "--warmup", "1", "--val-every", "4",
                 "--val-batches", "1", "--nproc", "1", "--no-progress", "--init-from",
                 str(tmp_path / "source"), "--space", "lr=log:1e-4:1e-2", "--max-trials", "2",
                 "--out", str(tmp_path / "search")]) == 0
    for trial in ("trial-0000", "trial-0001"):
        run_dir = tmp_path / "search" / trial
        assert Vocabulary.load(run_dir / "vocabulary.json") == source_vocab, trial
        assert "init-from" in (run_dir / "train.log").read_text(), trial
