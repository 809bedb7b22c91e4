"""Your own dataset (`--dataset PATH.py:FUNCTION`): the documented contract, its one-line
errors, and the file's sha256 in the run's record (contract 8)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from dptrain.data import Split, load_dataset
from dptrain.data.datasets.user_data import __doc__ as CONTRACT
from dptrain.errors import ConfigError, DataError
from dptrain.train.options import TrainOptions, run_record

SQUARES = """
import torch
from dptrain.data import Split

class Squares(torch.utils.data.Dataset):
    def __init__(self, n): self.x = torch.linspace(-1, 1, n)[:, None]
    def __len__(self): return len(self.x)
    def __getitem__(self, i): return self.x[i], self.x[i] ** 2

def squares():
    return Split(name="squares", task="regression", num_classes=None,
                 train=Squares(200), test=Squares(50))

def labels(bad=False):
    class Parity(torch.utils.data.Dataset):
        def __len__(self): return 30
        def __getitem__(self, i): return torch.full((3,), float(i)), (i % 2) + (5 if bad else 0)
    return Split(name="parity", task="classification", num_classes=2, train=Parity(),
                 test=Parity())

def not_a_split():
    return [1, 2]

def bad_label():
    return labels(bad=True)

def raises():
    raise RuntimeError("no disk")
"""


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_data.py"
    path.write_text(SQUARES)
    return path


def test_the_documented_example_loads_and_is_sized(data_file):
    split = load_dataset(f"{data_file}:squares")
    assert isinstance(split, Split) and split.input_shape == (1,) and split.output_dim == 1
    assert len(split.train) == 200 and torch.equal(split.test[1][1], split.test[1][0] ** 2)
    assert load_dataset(f"{data_file}:labels").num_classes == 2
    assert "FUNCTION()" in CONTRACT and "map-style" in CONTRACT


@pytest.mark.parametrize("function,error,message", [
    ("not_a_split", ConfigError, "returned a list; expected a dptrain.data.Split"),
    ("bad_label", DataError, "train[0]: a classification target must be a class id in [0, 2)"),
    ("raises", DataError, "RuntimeError while building the dataset: no disk"),
    ("nothing", ConfigError, "has no function 'nothing'"),
])
def test_a_dataset_that_breaks_the_contract_is_one_line(data_file, function, error, message):
    with pytest.raises(error) as info:
        load_dataset(f"{data_file}:{function}")
    assert message in str(info.value) and str(data_file) in str(info.value)


def test_the_file_joins_the_run_record(data_file):
    record = run_record(TrainOptions(dataset=f"{data_file}:squares"))
    assert record["dataset_sha256"] == hashlib.sha256(data_file.read_bytes()).hexdigest()
    assert "dataset_sha256" not in run_record(TrainOptions())
