"""Sampling text from a GPT: `dptrain.generation` and `load_run(RUN).generate`."""

from __future__ import annotations

import pytest
import torch

from dptrain.cli.main import main
from dptrain.data.datasets.vocabulary import Vocabulary
from dptrain.errors import ConfigError, DataError
from dptrain.generation import encode_prompt, generate_text
from dptrain.inference import load_run
from dptrain.models.gpt import GPT, GPTConfig

TEXT = "to be, or not to be: that is the question.\n" * 4


def _model(vocab: Vocabulary, block_size: int = 8) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab.size, block_size=block_size, layers=1, heads=2,
                         width=16))


def _sample(model, vocab, prompt="to be", seed=0, **kw):
    options = {"max_new_tokens": 40, "temperature": 1.0, "top_k": None, "seed": seed} | kw
    return generate_text(model, vocab, model.config.block_size, prompt, **options)


def test_the_same_seed_gives_the_same_text_and_another_seed_another():
    vocab = Vocabulary.from_text(TEXT)
    model = _model(vocab)
    first = _sample(model, vocab, seed=1)
    assert first.startswith("to be") and len(first) == len("to be") + 40
    assert _sample(model, vocab, seed=1) == first
    assert _sample(model, vocab, seed=2) != first
    # top_k 1 leaves one candidate: the seed no longer matters
    assert _sample(model, vocab, seed=1, top_k=1) == _sample(model, vocab, seed=2, top_k=1)


def test_temperature_zero_takes_the_most_likely_token_every_time():
    vocab = Vocabulary.from_text(TEXT)
    model = _model(vocab).eval()
    text = _sample(model, vocab, seed=1, temperature=0, max_new_tokens=12)
    assert text == _sample(model, vocab, seed=2, temperature=0, max_new_tokens=12)
    ids = vocab.encode("to be", where="test").unsqueeze(0)
    with torch.no_grad():
        for _ in range(12):  # greedy by hand
            nxt = model(ids[:, -8:])[0, -1].argmax().view(1, 1)
            ids = torch.cat([ids, nxt], dim=1)
    assert text == vocab.decode(ids[0])


def test_a_character_outside_the_vocabulary_is_refused_naming_it_and_its_position():
    vocab = Vocabulary.from_text(TEXT)
    with pytest.raises(DataError, match=r"^--prompt: the character 'Z' at position 3 is not "
                                        r"in the run's vocabulary"):
        _sample(_model(vocab), vocab, prompt="to Zebra")


def test_a_prompt_longer_than_the_context_keeps_its_last_block_and_says_so():
    vocab = Vocabulary.from_text(TEXT)
    notes = []
    model = _model(vocab)
    long = "or not to be"
    text = generate_text(model, vocab, 8, long, max_new_tokens=5, temperature=0, top_k=None,
                         seed=0, report=notes.append)
    assert notes == ["--prompt: 12 tokens is longer than the model's context of 8; it "
                     "continues the last 8"]
    # the continuation is that of the last block alone
    assert text[len(long):] == _sample(model, vocab, prompt=long[-8:], temperature=0,
                                       max_new_tokens=5)[8:]
    ids, note = encode_prompt(vocab, "to be", 8)
    assert ids.shape == (1, 5) and note is None


def test_an_empty_prompt_starts_from_a_newline_or_is_refused_without_one():
    vocab = Vocabulary.from_text(TEXT)
    ids, _ = encode_prompt(vocab, "", 8)
    assert vocab.decode(ids[0]) == "\n"
    assert len(_sample(_model(vocab), vocab, prompt="", max_new_tokens=6)) == 6
    no_newline = Vocabulary.from_text("abc")
    with pytest.raises(ConfigError, match="^--prompt: empty, and this run's vocabulary has no "
                                          "newline"):
        encode_prompt(no_newline, "", 8)
    assert encode_prompt(Vocabulary.bytes(), "", 8)[0].tolist() == [[10]]


@pytest.mark.parametrize("options, message", [
    ({"max_new_tokens": -1}, "--max-new-tokens: expected 0 or more"),
    ({"temperature": -0.5}, "--temperature: expected 0"),
    ({"top_k": 0}, "--top-k: expected 1 or more")])
def test_bad_sampling_options_are_refused(options, message):
    vocab = Vocabulary.from_text(TEXT)
    with pytest.raises(ConfigError, match=f"^{message}"):
        _sample(_model(vocab), vocab, **options)


def test_a_trained_run_generates_and_a_run_of_another_model_refuses(tmp_path):
    text = tmp_path / "tiny.txt"
    text.write_text(TEXT * 3, encoding="utf-8")
    out = tmp_path / "gpt"
    assert main(["train", "--model", "torch-gpt", "--dataset", f"text:{text}",
                 "--block-size", "8", "--layers", "1", "--heads", "2", "--width", "16",
                 "--batch-size", "4", "--max-steps", "4", "--warmup", "1", "--val-every", "4",
                 "--val-batches", "1", "--nproc", "1", "--no-progress", "--out",
                 str(out)]) == 0
    run = load_run(out)
    assert run.vocabulary == Vocabulary.load(out / "vocabulary.json")
    sample = run.generate("to be", max_new_tokens=20, seed=3)
    assert sample.startswith("to be") and len(sample) == 25
    assert run.generate("to be", max_new_tokens=20, seed=3) == sample

    other = tmp_path / "mlp"
    assert main(["train", "--model", "torch-mlp", "--dataset", "blobs", "--epochs", "1",
                 "--nproc", "1", "--no-progress", "--out", str(other)]) == 0
    with pytest.raises(ConfigError, match=r"generate is for language models trained on token "
                                          r"data .*; this run is torch-mlp on blobs$"):
        load_run(other).generate("to be")
