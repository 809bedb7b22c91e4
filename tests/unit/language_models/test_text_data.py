"""Token data: text:PATH and tokens:DIR (split, vocabulary, windows, epochs, bad files)."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from dptrain.data import ShardedSampler, accepted_names, load_dataset
from dptrain.data.config import DataConfig, load_split, resolve_workers
from dptrain.data.datasets import token_files
from dptrain.data.datasets.text import load_text, part_sizes
from dptrain.data.datasets.token_files import load_tokens
from dptrain.data.datasets.token_windows import TokenFile, TokenWindows, epoch_offset
from dptrain.data.datasets.vocabulary import Vocabulary
from dptrain.data.loader import BatchLoader
from dptrain.errors import ConfigError, DataError

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n" * 8


def _text(tmp_path: Path, text: str = TEXT, name: str = "input.txt") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _nanogpt_dir(tmp_path: Path, text: str = TEXT) -> tuple[Path, dict]:
    """train.bin / val.bin / meta.pkl as nanoGPT's shakespeare_char prepare step writes them
    (written here by our own code: uint16 ids, a pickled dict of the vocabulary)."""
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    cut = int(len(ids) * 0.9)
    ids[:cut].tofile(tmp_path / "train.bin")
    ids[cut:].tofile(tmp_path / "val.bin")
    meta = {"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}
    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump(meta, f)
    return tmp_path, {"ids": ids, "cut": cut, "chars": chars}


def _llmc_file(path: Path, ids: np.ndarray, magic: int = 20240520) -> None:
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, 1 if magic == 20240520 else 7, len(ids)
    dtype = "<u2" if magic == 20240520 else "<u4"
    path.write_bytes(header.tobytes() + ids.astype(dtype).tobytes())


# text: ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 9, 10, 11, 1000, 1115394, 1_000_003])
def test_a_validation_fraction_splits_as_nanogpt_does(n):
    if n < 2:
        with pytest.raises(DataError, match="nothing is left to train on"):
            part_sizes(n, val_size="0.1", test_size=None, where="t")
        return
    train_end, val_end = part_sizes(n, val_size="0.1", test_size=None, where="t")
    assert (train_end, val_end) == (int(n * 0.9), n)


def test_parts_in_order_train_validation_test_with_counts_and_fractions():
    assert part_sizes(1000, val_size="100", test_size="50", where="t") == (850, 950)
    assert part_sizes(1000, val_size="0.1", test_size="0.2", where="t") == (700, 800)
    assert part_sizes(1000, val_size=None, test_size=None, where="t") == (900, 1000)
    with pytest.raises(ConfigError, match="--test-size"):
        part_sizes(1000, val_size=None, test_size="0", where="t")


def test_text_split_by_position_vocabulary_from_the_training_part(tmp_path):
    text = "abcabcabca" * 10 + "xyz" + "abc" * 9  # 130 characters; x, y, z only at the end
    split = load_text(str(_text(tmp_path, text)), val_size="30", block_size=4)
    vocab = split.vocabulary
    assert vocab.kind == "char" and vocab.tokens == ("a", "b", "c") and vocab.size == 4
    assert split.num_classes == 4 and split.task == "classification"
    assert split.unknown_tokens == {"validation": 3}
    assert split.train.num_tokens == 100 and split.validation.num_tokens == 30
    assert split.test is split.validation  # no test part asked for
    val_ids = torch.cat([split.validation[i][0] for i in range(len(split.validation))])
    assert vocab.decode(val_ids).startswith("\ufffd" * 3 + "abc")
    assert split.input_shape == (4,)


def test_text_test_part_is_last_and_counts_its_own_unknowns(tmp_path):
    text = "ab" * 40 + "abcd" * 5 + "abee" * 5  # train 80, validation 20, test 20
    split = load_text(str(_text(tmp_path, text)), val_size="20", test_size="20", block_size=3)
    assert split.unknown_tokens == {"validation": 10, "test": 10}
    assert split.test is not split.validation
    unknown = split.vocabulary.unknown_id
    assert split.test[0][0].tolist() == [0, 1, unknown]
    assert split.validation[0][0].tolist() == [0, 1, unknown]


def test_byte_tokenizer_has_the_256_bytes_and_splits_by_byte(tmp_path):
    text = "héllo wörld " * 20  # two-byte characters
    split = load_text(str(_text(tmp_path, text)), tokenizer="byte", val_size="0.25",
                      block_size=8)
    raw = text.encode("utf-8")
    assert split.vocabulary.kind == "byte" and split.num_classes == 256
    assert split.train.num_tokens == math.floor(0.75 * len(raw))
    assert split.unknown_tokens == {"validation": 0}
    x, y = split.validation[0]
    start = split.train.num_tokens
    assert x.tolist() == list(raw[start:start + 8]) and y.tolist() == list(raw[start + 1:start + 9])


def test_a_folder_of_txt_is_read_in_name_order(tmp_path):
    for name, text in (("b.txt", "BBBB\n" * 10), ("a.txt", "AAAA\n" * 10),
                       ("c.md", "not read\n" * 10), ("c.txt", "CCCC\n" * 10)):
        _text(tmp_path, text, name)
    split = load_text(str(tmp_path), val_size="50", block_size=4)
    assert split.vocabulary.tokens == ("\n", "A", "B")  # the training part: a.txt, b.txt
    assert split.unknown_tokens == {"validation": 40}  # c.txt's C's
    assert split.vocabulary.decode(split.train.source.ids[:100]) == "AAAA\n" * 10 + "BBBB\n" * 10


@pytest.mark.parametrize("content, match", [
    (b"", "the text is empty"),
    (b"  \n\t\n ", "only whitespace"),
    (b"hello\nw\xf6rld\n", r"input.txt: not UTF-8 text: byte 7 \(0xf6\)"),
])
def test_bad_texts_fail_in_one_line(tmp_path, content, match):
    (tmp_path / "input.txt").write_bytes(content)
    with pytest.raises(DataError, match=match) as err:
        load_text(str(tmp_path / "input.txt"))
    assert "\n" not in str(err.value)


def test_missing_text_and_a_folder_without_txt(tmp_path):
    with pytest.raises(DataError, match="no such file or folder"):
        load_text(str(tmp_path / "nope.txt"))
    with pytest.raises(DataError, match=r"no \*\.txt file"):
        load_text(str(tmp_path))


@pytest.mark.parametrize("sizes, part", [
    ({"val_size": "10"}, "the validation part"),
    ({"val_size": "50", "test_size": "10"}, "the test part"),
    ({"val_size": "0.95"}, "the training part"),
])
def test_a_block_longer_than_a_part_is_refused_naming_it(tmp_path, sizes, part):
    path = _text(tmp_path, "abcdefghij" * 20)
    with pytest.raises(DataError, match=f"{part}: --block-size 16 needs at least 17 tokens"):
        load_text(str(path), block_size=16, **sizes)


# windows and epochs ---------------------------------------------------------------------------

def test_windows_are_block_size_tokens_and_targets_shift_by_one(tmp_path):
    split = load_text(str(_text(tmp_path)), block_size=8, seed=5)
    ids = split.train.source.ids
    for epoch in range(4):
        split.train.set_epoch(epoch)
        for i in (0, 3, len(split.train) - 1):
            x, y = split.train[i]
            start = split.train.start_of(i)
            assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (8,)
            assert x.tolist() == ids[start:start + 8].tolist()
            assert y.tolist() == ids[start + 1:start + 9].tolist()
        assert split.train.start_of(len(split.train) - 1) + 9 <= split.train.num_tokens


def test_validation_windows_are_fixed_from_the_start_of_their_part(tmp_path):
    split = load_text(str(_text(tmp_path)), block_size=8, seed=5)
    val = split.validation
    starts = [val.start_of(i) for i in range(len(val))]
    val.set_epoch(7)
    assert starts == [val.start_of(i) for i in range(len(val))]
    assert starts == list(range(split.train.num_tokens, split.train.num_tokens + 8 * len(val), 8))
    assert len(val) == (val.num_tokens - 1) // 8


def test_the_epoch_offset_is_a_function_of_seed_and_epoch():
    offsets = [epoch_offset(3, e, 63) for e in range(40)]
    assert offsets == [epoch_offset(3, e, 63) for e in range(40)]
    assert all(0 <= o <= 63 for o in offsets) and len(set(offsets)) > 10
    assert offsets != [epoch_offset(4, e, 63) for e in range(40)]
    assert epoch_offset(3, 5, 0) == 0


def test_a_training_part_shorter_than_two_blocks_still_has_a_window():
    windows = TokenWindows(_array(12), 0, 12, block_size=8, name="t", shuffle_offset=True)
    assert len(windows) == 1 and windows.max_offset == 3
    for epoch in range(20):
        windows.set_epoch(epoch)
        assert windows[0][1][-1].item() < 12


def _array(n: int):
    from dptrain.data.datasets.token_windows import TokenArray
    return TokenArray(np.arange(n, dtype=np.uint16))


def _epoch_windows(windows: TokenWindows, world_size: int, local_batch: int, epoch: int,
                   state: dict | None = None) -> list[list[list[int]]]:
    """Per global step, the first tokens of the windows every rank trains on (rank 0's
    batch, then rank 1's ...), through the Trainer's loader."""
    steps: list[list[list[int]]] = []
    for rank in range(world_size):
        sampler = ShardedSampler(windows, rank=rank, world_size=world_size, seed=11)
        if state is not None:
            sampler.load_state_dict(state)
        sampler.set_epoch(epoch)
        for k, (x, _) in enumerate(BatchLoader(windows, sampler, local_batch)):
            if len(steps) <= k:
                steps.append([])
            steps[k].extend(x[:, 0].tolist())
    return steps


def test_ranks_shares_are_disjoint_and_cover_the_epoch():
    windows = TokenWindows(_array(2000), 0, 2000, block_size=16, name="t", seed=11,
                           shuffle_offset=True)
    windows.set_epoch(3)  # what the loader does before it fetches
    per_rank = []
    for rank in range(2):
        sampler = ShardedSampler(windows, rank=rank, world_size=2, seed=11)
        sampler.set_epoch(3)
        per_rank.append([windows[i][0][0].item() for i in sampler])
    everything = sorted(windows.start_of(i) for i in range(len(windows)))
    assert len(windows) % 2 == 0  # no padding: disjoint exactly
    assert not set(per_rank[0]) & set(per_rank[1])
    assert sorted(per_rank[0] + per_rank[1]) == everything
    assert {s % 16 for s in everything} == {windows.offset}


def test_the_same_windows_on_one_and_two_ranks_and_after_resuming_on_the_other():
    windows = TokenWindows(_array(3000), 0, 3000, block_size=16, name="t", seed=11,
                           shuffle_offset=True)
    for epoch in range(3):
        one = _epoch_windows(windows, 1, 8, epoch)
        two = _epoch_windows(windows, 2, 4, epoch)
        assert [sorted(s) for s in one] == [sorted(s) for s in two]
    # a run of two ranks stopped after 5 steps of epoch 2 goes on with one rank
    sampler = ShardedSampler(windows, rank=0, world_size=2, seed=11)
    sampler.set_epoch(2)
    sampler.set_position(5 * 4)
    rest = _epoch_windows(windows, 1, 8, 2, state=sampler.state_dict())
    assert [sorted(s) for s in rest] == [sorted(s) for s in one[5:]]


# tokens: --------------------------------------------------------------------------------------

def test_tokens_in_nanogpts_layout(tmp_path):
    root, made = _nanogpt_dir(tmp_path)
    split = load_tokens(str(root), block_size=8, seed=1)
    assert split.vocabulary.kind == "ids" and split.num_classes == len(made["chars"])
    assert split.vocabulary.tokens == tuple(made["chars"])
    assert split.train.num_tokens == made["cut"]
    assert split.test is split.validation
    x, y = split.validation[1]
    assert x.tolist() == made["ids"][made["cut"] + 8:made["cut"] + 16].tolist()
    assert y.tolist() == made["ids"][made["cut"] + 9:made["cut"] + 17].tolist()
    assert split.vocabulary.decode(split.validation[0][0]) == TEXT[made["cut"]:made["cut"] + 8]
    assert isinstance(split.train.source, TokenFile)
    assert split.fingerprint == load_tokens(str(root), block_size=4).fingerprint
    assert load_tokens(str(root), vocabulary=split.vocabulary, block_size=4).num_classes == \
        split.num_classes
    with pytest.raises(DataError, match=r"ids of a vocabulary of 27, but the run's vocabulary "
                                        r"is ids of 50257"):
        load_tokens(str(root), vocabulary=Vocabulary(kind="ids", size=50257))


def test_tokens_with_llmc_headers_and_a_test_bin(tmp_path):
    rng = np.random.default_rng(0)
    parts = {name: rng.integers(0, 50257, size=n) for name, n in
             (("train", 500), ("val", 100), ("test", 90))}
    for name, ids in parts.items():
        _llmc_file(tmp_path / f"{name}.bin", ids)
    split = load_tokens(str(tmp_path), block_size=16)
    assert split.num_classes == 50257 and split.vocabulary.tokens is None
    assert (split.train.num_tokens, split.validation.num_tokens, split.test.num_tokens) == \
        (500, 100, 90)
    assert split.test[2][0].tolist() == parts["test"][32:48].tolist()


def test_tokens_uint32_with_meta_json(tmp_path):
    ids = np.arange(300, dtype="<u4") * 1000 + 70000
    ids[:200].tofile(tmp_path / "train.bin")
    ids[200:].tofile(tmp_path / "val.bin")
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 400000, "dtype": "uint32"}))
    split = load_tokens(str(tmp_path), block_size=4)
    assert split.num_classes == 400000
    assert split.validation[0][1].tolist() == ids[201:205].tolist()


class _Payload:
    """What an attacker's meta.pkl does when unpickled: call a function of its choice."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_malicious_meta_pkl_is_refused_without_running_it(tmp_path):
    root, _ = _nanogpt_dir(tmp_path)
    marker = tmp_path / "pwned"
    with open(root / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 40, "itos": _Payload(marker)}, f)
    with pytest.raises(DataError, match="refusing to load global pathlib"):
        load_tokens(str(root))
    assert not marker.exists()


def _plain(tmp_path: Path, train: bytes, val: bytes, vocab: int = 10) -> Path:
    (tmp_path / "train.bin").write_bytes(train)
    (tmp_path / "val.bin").write_bytes(val)
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": vocab}))
    return tmp_path


def test_bad_token_files_fail_in_one_line_naming_the_file(tmp_path, monkeypatch):
    good = np.arange(40, dtype="<u2") % 10
    root = _plain(tmp_path, good.tobytes() + b"\x01", good.tobytes())
    with pytest.raises(DataError, match=r"train.bin: 81 bytes is not a whole number of uint16"):
        load_tokens(str(root), block_size=4)
    # an id past the vocabulary in a later chunk of the check: its position in the file
    monkeypatch.setattr(token_files, "CHECK_CHUNK", 7)
    bad = good.copy()
    bad[33] = 10
    root = _plain(tmp_path, good.tobytes(), bad.tobytes())
    with pytest.raises(DataError, match=r"val.bin: id 10 at position 33 is not below the "
                                        r"vocabulary size 10") as err:
        load_tokens(str(root), block_size=4)
    assert "\n" not in str(err.value)
    _llmc_file(tmp_path / "val.bin", good)
    with open(tmp_path / "val.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(DataError, match=r"val.bin: its llm.c header says 40 tokens of 2 bytes, "
                                        r"but 82 bytes follow it"):
        load_tokens(str(root), block_size=4)
    (tmp_path / "val.bin").unlink()
    with pytest.raises(DataError, match="val.bin: file not found"):
        load_tokens(str(root), block_size=4)
    good.tofile(tmp_path / "val.bin")
    (tmp_path / "meta.json").unlink()
    with pytest.raises(DataError, match="no meta.json or meta.pkl"):
        load_tokens(str(root), block_size=4)
    (tmp_path / "meta.json").write_text('{"vocab_size": 10, "dtype": "int8"}')
    with pytest.raises(DataError, match="dtype must be uint16 or uint32"):
        load_tokens(str(root), block_size=4)
    (tmp_path / "meta.json").write_text('{"vocab_size": 10}')
    with pytest.raises(DataError, match=r"train.bin: --block-size 40 needs at least 41 tokens"):
        load_tokens(str(root), block_size=40)


def test_a_token_file_reads_windows_by_position_after_its_header(tmp_path):
    ids = np.arange(70000, 75000, dtype="<u4")
    (tmp_path / "ids.bin").write_bytes(b"h" * 12 + ids.tobytes())
    source = TokenFile(tmp_path / "ids.bin", np.dtype("<u4"), 12, 5000)
    for start in range(0, 4900, 97):
        got = source.read(start, start + 9)
        assert got.dtype == np.int64 and got.tolist() == list(range(70000 + start, 70009 + start))
    clone = pickle.loads(pickle.dumps(source))  # a spawned worker's copy opens its own
    assert clone.read(10, 12).tolist() == [70010, 70011]
    with open(tmp_path / "ids.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(DataError, match="ids.bin: ids 4000 to 4009 read 0 of 36 bytes"):
        source.read(4000, 4009)


# the registry and DataConfig -------------------------------------------------------------------

def test_text_and_tokens_are_known_to_the_registry_and_the_config(tmp_path):
    assert "text:PATH" in accepted_names() and "tokens:PATH" in accepted_names()
    path = _text(tmp_path, TEXT * 2)
    assert load_dataset(f"text:{path}").input_shape == (64,)
    split = load_split(DataConfig(dataset=f"text:{path}", block_size=8, val_size="0.2",
                                  test_size="0.1"), seed=3)
    assert split.input_shape == (8,) and split.train.seed == 3
    assert split.test is not split.validation
    assert resolve_workers(DataConfig(dataset=f"text:{path}"), split, cores=8) == 0
    none = load_split(DataConfig(dataset=f"text:{path}", val_size="none"), seed=0)
    assert none.validation is None


@pytest.mark.parametrize("config, match", [
    (dict(dataset="digits", block_size=8), "block.size: for token data"),
    (dict(dataset="digits", tokenizer="byte"), "tokenizer: for token data"),
    (dict(dataset="tokens:{root}", val_size="0.2"), "has a validation part of its own"),
    (dict(dataset="tokens:{root}", tokenizer="byte"), "tokenized already"),
    (dict(dataset="tokens:{root}", test_size="0.1"), "its test.bin"),
    (dict(dataset="text:{root}/input.txt", lookback=4), "lookback: for time series"),
])
def test_options_for_other_data_are_refused(tmp_path, config, match):
    root, _ = _nanogpt_dir(tmp_path)
    _text(tmp_path)
    config = {k: v.format(root=root) if isinstance(v, str) else v for k, v in config.items()}
    with pytest.raises(ConfigError, match=match):
        load_split(DataConfig(**config), seed=0)


def test_bad_tokenizer_and_block_size_are_config_errors():
    with pytest.raises(ConfigError, match="tokenizer"):
        DataConfig(tokenizer="word")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="block_size|block-size"):
        DataConfig(block_size=0)


def test_a_given_vocabulary_is_kept_and_a_new_character_refused(tmp_path):
    source = load_text(str(_text(tmp_path, TEXT * 2)), block_size=8).vocabulary
    other = tmp_path / "other"
    other.mkdir()
    kept = load_split(DataConfig(dataset=f"text:{_text(other, TEXT[::-1] * 2)}", block_size=8),
                      seed=0, vocabulary=source)
    assert kept.vocabulary == source and kept.unknown_tokens == {"validation": 0}
    path = _text(other, TEXT + "héllo\n" + TEXT)  # é and two l's that TEXT has not
    at, line = len(TEXT) + 1, TEXT.count("\n") + 1
    with pytest.raises(DataError, match=rf"text:input.txt: the character 'é' at position {at} "
                                        rf"\(line {line}\) is not in the vocabulary of the run "
                                        rf"\(27 characters\); 3 such character"):
        load_split(DataConfig(dataset=f"text:{path}", block_size=8), seed=0, vocabulary=source)
    with pytest.raises(ConfigError, match="of kind char; use --tokenizer char"):
        load_split(DataConfig(dataset=f"text:{path}", tokenizer="byte"), seed=0,
                   vocabulary=source)
    with pytest.raises(ConfigError, match="a vocabulary is for token data"):
        load_split(DataConfig(dataset="digits"), seed=0, vocabulary=source)


def test_llmc_uint32_files_and_a_meta_json_that_contradicts_their_header(tmp_path):
    ids = np.arange(100_000, 100_300)
    _llmc_file(tmp_path / "train.bin", ids[:200], magic=20240801)
    _llmc_file(tmp_path / "val.bin", ids[200:], magic=20240801)
    split = load_tokens(str(tmp_path), block_size=8)
    assert split.num_classes == 128256  # Llama 3's tokenizer
    assert split.validation[0][0].tolist() == ids[200:208].tolist()
    (tmp_path / "meta.json").write_text('{"vocab_size": 200000, "dtype": "uint16"}')
    with pytest.raises(DataError, match="train.bin: its llm.c header says uint32 ids, but "
                                        ".*meta.json says uint16"):
        load_tokens(str(tmp_path), block_size=8)
