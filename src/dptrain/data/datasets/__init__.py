"""Datasets as in-memory tensors with fixed train/test splits (see `load_dataset`)."""

from dptrain.data.datasets.base import ArrayDataset, Normalisation, Split
from dptrain.data.datasets.cifar10 import load_cifar10, read_cifar_binary, read_cifar_pickle
from dptrain.data.datasets.idx import load_mnist, read_idx
from dptrain.data.datasets.registry import accepted_names, load_dataset
from dptrain.data.datasets.sklearn_sets import load_diabetes, load_digits
from dptrain.data.datasets.table import load_csv, load_npz, read_csv
from dptrain.data.datasets.text import load_text
from dptrain.data.datasets.token_files import load_tokens
from dptrain.data.datasets.toy1d import load_toy1d, load_toy1d_hetero

__all__ = [
    "ArrayDataset", "Normalisation", "Split", "accepted_names", "load_cifar10", "load_csv",
    "load_dataset", "load_diabetes", "load_digits", "load_mnist", "load_npz", "load_text", "load_tokens", "load_toy1d", "load_toy1d_hetero",
    "read_cifar_binary", "read_cifar_pickle", "read_csv", "read_idx",
]
