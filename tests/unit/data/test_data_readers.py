"""Readers round-trip small real files written here, and every bad file fails naming itself.

Pins docs/design.md contract 6: unreadable, truncated or inconsistent data files raise DataError
that says which file and what is wrong, never a silently wrong dataset.
"""

from __future__ import annotations

import gzip
import io
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from dptrain.data import load_cifar10, load_csv, load_dataset, load_mnist, load_npz, read_idx
from dptrain.errors import ConfigError, DataError

# ---------------------------------------------------------------- MNIST / Fashion-MNIST (IDX)


def write_idx(path: Path, array: np.ndarray, *, magic: int | None = None,
              compress: bool = False) -> Path:
    """A real IDX file: magic (0, 0, type 0x08, ndim), big-endian dims, the bytes."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    magic = 0x0800 + array.ndim if magic is None else magic
    data = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    data += array.tobytes()
    path.write_bytes(gzip.compress(data) if compress else data)
    return path


def make_mnist(directory: Path, *, num_train: int = 12, num_test: int = 5,
               compress: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    arrays = {"train-images-idx3-ubyte": rng.integers(0, 256, (num_train, 28, 28)),
              "train-labels-idx1-ubyte": np.arange(num_train) % 10,
              "t10k-images-idx3-ubyte": rng.integers(0, 256, (num_test, 28, 28)),
              "t10k-labels-idx1-ubyte": (np.arange(num_test) * 3) % 10}
    directory.mkdir(parents=True, exist_ok=True)
    for name, array in arrays.items():
        write_idx(directory / (name + (".gz" if compress else "")), array, compress=compress)
    return arrays


@pytest.mark.parametrize("compress", [False, True])
def test_mnist_round_trips_raw_and_gzip(tmp_path, compress):
    arrays = make_mnist(tmp_path, compress=compress)
    split = load_mnist(tmp_path)
    assert split.input_shape == (1, 28, 28) and split.num_classes == 10
    assert split.test.y.tolist() == arrays["t10k-labels-idx1-ubyte"].tolist()
    raw = torch.from_numpy(arrays["t10k-images-idx3-ubyte"]).float().unsqueeze(1)
    torch.testing.assert_close(split.x_norm.apply(raw), split.test.x)
    pixels = arrays["train-images-idx3-ubyte"].astype(np.float64)
    assert split.x_norm.mean.item() == pytest.approx(pixels.mean(), rel=1e-5)  # train only
    assert split.x_norm.std.item() == pytest.approx(pixels.std(), rel=1e-5)


def test_fashion_mnist_flat_through_load_dataset(tmp_path):
    make_mnist(tmp_path / "raw")  # torchvision's layout
    split = load_dataset(f"fashion-mnist:{tmp_path}", flat=True)
    assert split.name == "fashion-mnist" and split.input_shape == (784,)
    assert (len(split.train), len(split.test)) == (12, 5)


def test_read_idx_generic(tmp_path):
    array = np.arange(24).reshape(2, 3, 4)
    assert np.array_equal(read_idx(write_idx(tmp_path / "a", array)), array)


@pytest.mark.parametrize("damage, match", [
    ("magic", r"wrong magic number 2049 \(0x00000801\) at byte 0, expected 2051"),
    ("truncate", r"truncated: the header says shape \(12, 28, 28\)"),
    ("trailing", "trailing bytes after the data"),
    ("header", "truncated IDX file: 2 bytes"),
    ("gzip", "corrupt or truncated gzip file"),
])
def test_mnist_bad_images_file_is_named(tmp_path, damage, match):
    make_mnist(tmp_path)
    path = tmp_path / "train-images-idx3-ubyte"
    data = path.read_bytes()
    if damage == "magic":
        write_idx(path, np.zeros((12, 28, 28)), magic=2049)
    elif damage == "truncate":
        path.write_bytes(data[:-100])
    elif damage == "trailing":
        path.write_bytes(data + b"\0")
    elif damage == "header":
        path.write_bytes(data[:2])
    elif damage == "gzip":
        path.unlink()
        Path(str(path) + ".gz").write_bytes(gzip.compress(data)[:-20])
    with pytest.raises(DataError, match=match) as info:
        load_mnist(tmp_path)
    assert "train-images-idx3-ubyte" in str(info.value)


def test_mnist_label_count_and_range_and_missing_files(tmp_path):
    make_mnist(tmp_path)
    labels = tmp_path / "t10k-labels-idx1-ubyte"
    write_idx(labels, np.zeros(4))
    with pytest.raises(DataError, match=r"t10k-labels-idx1-ubyte: 4 labels but .*t10k-images"
                                        r"-idx3-ubyte holds 5 images"):
        load_mnist(tmp_path)
    write_idx(labels, [1, 2, 10, 3, 4])
    with pytest.raises(DataError, match=r"t10k-labels-idx1-ubyte: labels must be in \[0, 10\), "
                                        r"got 10 at index 2"):
        load_mnist(tmp_path)
    labels.unlink()
    with pytest.raises(DataError, match="MNIST t10k labels .* file not found; looked for"):
        load_mnist(tmp_path)
    with pytest.raises(DataError, match="nowhere: MNIST directory not found"):
        load_mnist(tmp_path / "nowhere")


# ---------------------------------------------------------------- CIFAR-10


def cifar_arrays(num: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (num, 3072), dtype=np.uint8), rng.integers(0, 10, num)


def write_cifar_binary(directory: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    directory.mkdir(parents=True, exist_ok=True)
    parts = {}
    for i, name in enumerate([*(f"data_batch_{k}" for k in range(1, 6)), "test_batch"]):
        data, labels = parts[name] = cifar_arrays(2 + i % 2, seed=i)
        records = np.concatenate([labels.astype(np.uint8)[:, None], data], axis=1)
        (directory / f"{name}.bin").write_bytes(records.tobytes())
    return parts


class Py2Pickler(pickle._Pickler):
    """Writes str and bytes as Python 2 wrote its str, with (SHORT_)BINSTRING opcodes."""

    dispatch = dict(pickle._Pickler.dispatch)

    def save_py2_str(self, obj):
        data = obj.encode("latin1") if isinstance(obj, str) else obj
        if len(data) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(data)]) + data)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(data)) + data)
        self.memoize(obj)

    dispatch[str] = save_py2_str
    dispatch[bytes] = save_py2_str


def write_cifar_pickle(directory: Path, *, python2_style: bool = True
                       ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Batches as the official files are (Python 2 pickles: str written as BINSTRING, globals
    from numpy 1's numpy.core), or as a modern re-pickled copy (str keys, protocol 5)."""
    directory.mkdir(parents=True, exist_ok=True)
    parts = {}
    for i, name in enumerate([*(f"data_batch_{k}" for k in range(1, 6)), "test_batch"]):
        data, labels = parts[name] = cifar_arrays(3, seed=10 + i)
        if python2_style:
            batch = {"batch_label": name, "labels": labels.tolist(), "data": data,
                     "filenames": ["a.png", "b.png", "c.png"]}
            buf = io.BytesIO()
            Py2Pickler(buf, protocol=2).dump(batch)
            blob = buf.getvalue().replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
        else:
            blob = pickle.dumps({"labels": labels.tolist(), "data": data}, protocol=5)
        (directory / name).write_bytes(blob)
    return parts


def _expected(parts, names):
    data = np.concatenate([parts[n][0] for n in names]).reshape(-1, 3, 32, 32)
    return torch.from_numpy(data).float(), np.concatenate([parts[n][1] for n in names]).tolist()


@pytest.mark.parametrize("fmt", ["binary", "python", "python3"])
def test_cifar10_round_trips(tmp_path, fmt):
    if fmt == "binary":
        parts = write_cifar_binary(tmp_path / "cifar-10-batches-bin")
    else:
        parts = write_cifar_pickle(tmp_path / "cifar-10-batches-py",
                                   python2_style=fmt == "python")
    split = load_dataset(f"cifar10:{tmp_path}")
    train_x, train_y = _expected(parts, [f"data_batch_{k}" for k in range(1, 6)])
    test_x, test_y = _expected(parts, ["test_batch"])
    assert split.input_shape == (3, 32, 32) and split.train.y.tolist() == train_y
    assert split.test.y.tolist() == test_y and split.test.y.dtype == torch.int64
    torch.testing.assert_close(split.x_norm.apply(test_x), split.test.x)
    torch.testing.assert_close(split.x_norm.mean.flatten(), train_x.mean(dim=(0, 2, 3)))
    flat = load_cifar10(tmp_path, flat=True)
    torch.testing.assert_close(flat.test.x, split.test.x.reshape(-1, 3072))
    torch.testing.assert_close(flat.x_norm.apply(test_x.reshape(-1, 3072)), flat.test.x)


class _Exploit:
    def __reduce__(self):
        return (print, ("pickle ran code",))


def _damage_pickle(directory: Path, damage: str) -> None:
    path = directory / "data_batch_3"
    if damage == "code":
        path.write_bytes(pickle.dumps({b"data": _Exploit()}, protocol=2))
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:-50])
    elif damage == "labels":
        data, _ = cifar_arrays(3, seed=0)
        path.write_bytes(pickle.dumps({b"data": data, b"labels": [0, 11, 2]}, protocol=2))
    elif damage == "count":
        data, _ = cifar_arrays(3, seed=0)
        path.write_bytes(pickle.dumps({b"data": data, b"labels": [0, 1]}, protocol=2))
    elif damage == "shape":
        path.write_bytes(pickle.dumps({b"data": np.zeros((3, 100), np.uint8),
                                       b"labels": [0, 1, 2]}, protocol=2))


@pytest.mark.parametrize("damage, match", [
    ("code", r"refusing to load global (__builtin__|builtins)\.print"),
    ("truncated", "not a readable CIFAR-10 python batch"),
    ("labels", r"labels must be in \[0, 10\), got 11 at index 1"),
    ("count", "2 labels but 3 images"),
    ("shape", r"'data' must be a uint8 array of shape \(N, 3072\), got uint8 array \(3, 100\)"),
])
def test_cifar10_bad_pickle_is_named_and_never_executed(tmp_path, capsys, damage, match):
    write_cifar_pickle(tmp_path)
    _damage_pickle(tmp_path, damage)
    with pytest.raises(DataError, match=match) as info:
        load_cifar10(tmp_path, format="python")
    assert "data_batch_3" in str(info.value)
    assert "pickle ran code" not in capsys.readouterr().out


@pytest.mark.parametrize("damage, match", [
    ("truncate", "size 9218 bytes is not a positive multiple of 3073"),
    ("labels", r"labels must be in \[0, 10\), got 200 at index 0"),
    ("missing", r"CIFAR-10 binary batch: file not found; looked for:\n.*data_batch_4.bin"),
])
def test_cifar10_bad_binary_is_named(tmp_path, damage, match):
    write_cifar_binary(tmp_path)
    path = tmp_path / "data_batch_4.bin"
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:-1])
    elif damage == "labels":
        path.write_bytes(bytes([200]) + path.read_bytes()[1:])
    else:
        path.unlink()
    with pytest.raises(DataError, match=match) as info:
        load_cifar10(tmp_path)
    assert "data_batch_4.bin" in str(info.value)


def test_cifar10_directory_without_batches(tmp_path):
    with pytest.raises(DataError, match="no CIFAR-10 batches found"):
        load_cifar10(tmp_path)
    with pytest.raises(ConfigError, match="format must be one of"):
        load_cifar10(tmp_path, format="hdf5")


# ---------------------------------------------------------------- CSV / NPZ tables

CSV = "size,rooms,age,price\n" + "\n".join(
    f"{10 + i},{i % 4 + 1},{(7 * i) % 30},{100 + 3 * i}" for i in range(20)) + "\n"


def test_csv_round_trips_with_target_by_name_index_or_several(tmp_path):
    path = tmp_path / "houses.csv"
    path.write_text(CSV)
    table = np.array([[float(v) for v in line.split(",")] for line in CSV.splitlines()[1:]])
    split = load_dataset(str(path), target="price", test_fraction=0.25, seed=3)
    assert (len(split.train), len(split.test)) == (15, 5) and split.input_shape == (3,)
    x = split.x_norm.invert(torch.cat([split.train.x, split.test.x]))
    y = split.y_norm.invert(torch.cat([split.train.y, split.test.y]))
    rows = torch.cat([x, y], dim=1).double().numpy()
    np.testing.assert_allclose(rows[np.lexsort(rows.T[::-1])], table, rtol=1e-5)
    assert split.train.x.mean().abs() < 1e-5  # standardised with train stats
    by_index = load_csv(path, target=-1, test_fraction=0.25, seed=3)
    assert torch.equal(by_index.test.y, split.test.y)
    assert torch.equal(load_dataset(f"csv:{path}", target="3", test_fraction=0.25,
                                    seed=3).test.x, split.test.x)
    two = load_csv(path, target=["price", 0])
    assert two.output_dim == 2 and two.input_shape == (2,)


def test_csv_without_header_uses_indices(tmp_path):
    path = tmp_path / "plain.csv"
    path.write_text("1,2,3\n4,5,6\n7,8,9\n10,11,12\n")
    split = load_csv(path, target=0, test_fraction=0.25)
    assert split.input_shape == (2,) and len(split.test) == 1
    with pytest.raises(DataError, match="given by name, but the file has no column names"):
        load_csv(path, target="price")


@pytest.mark.parametrize("text, target, match", [
    ("a,b\n1,2\n3,nan\n5,6\n", -1, r"line 3, column 2: nan"),
    ("a,b\n1,2\n3,4\n5,inf\n", -1, r"line 4, column 2: inf"),
    ("a,b\n1,2\n3,x\n5,6\n", -1, r"line 3, column 2: not a number: 'x'"),
    ("a,b\n1,2\n3,\n5,6\n", -1, r"line 3, column 2: empty cell"),
    ("a,b\n1,2\n3,4,5\n5,6\n", -1, r"line 3 has 3 columns, expected 2"),
    ("a,b\n1,2\n3,4\n5,6\n", "price", r"no column named 'price'; the columns are \['a', 'b'\]"),
    ("a,b\n1,2\n3,4\n5,6\n", 5, "target column index 5 out of range for 2 columns"),
    ("a,b\n1,2\n3,4\n5,6\n", ["a", "b"], "every column is a target"),
    ("a,b\n", -1, "has a header but no data rows"),
])
def test_bad_csv_is_named(tmp_path, text, target, match):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(DataError, match=match) as info:
        load_csv(path, target=target)
    assert str(path) in str(info.value)


def test_missing_table_files(tmp_path):
    for loader in (load_csv, load_npz):
        with pytest.raises(DataError, match="nope.*: file not found"):
            loader(tmp_path / "nope")


def test_npz_layouts(tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(30, 4)), rng.normal(size=30)
    np.savez(tmp_path / "fixed.npz", x_train=x[:20], y_train=y[:20], x_test=x[20:],
             y_test=y[20:])
    fixed = load_dataset(f"npz:{tmp_path / 'fixed.npz'}")
    assert (len(fixed.train), len(fixed.test)) == (20, 10)
    torch.testing.assert_close(fixed.x_norm.invert(fixed.test.x).double(),
                               torch.from_numpy(x[20:]), atol=1e-5, rtol=1e-5)
    np.savez(tmp_path / "xy.npz", x=x, y=y)
    xy = load_npz(tmp_path / "xy.npz", test_fraction=0.1)
    assert (len(xy.train), len(xy.test)) == (27, 3) and xy.output_dim == 1
    np.savez(tmp_path / "table.npz", data=np.c_[x, y], columns=np.array(["a", "b", "c", "d",
                                                                         "t"]))
    table = load_dataset(str(tmp_path / "table.npz"), target="t", test_fraction=0.1)
    assert torch.equal(table.test.y, xy.test.y) and torch.equal(table.train.x, xy.train.x)


@pytest.mark.parametrize("arrays, match", [
    ({"x": np.array([[1.0], [np.nan], [2.0]]), "y": np.zeros(3)}, r"\['x'\].*NaN/inf.*\(1, 0\)"),
    ({"x": np.zeros((3, 2)), "y": np.zeros(4)}, r"must be \(N, F\)"),
    ({"data": np.array([[1, None]], dtype=object)}, "cannot load without pickle"),
    ({"p": np.zeros((3, 2)), "q": np.zeros((3, 2))}, "cannot tell which array is the table"),
])
def test_bad_npz_is_named(tmp_path, arrays, match):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(DataError, match=match) as info:
        load_npz(path)
    assert str(path) in str(info.value)


def test_not_an_npz(tmp_path):
    path = tmp_path / "junk.npz"
    path.write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(DataError, match="junk.npz: not a readable NPZ file"):
        load_npz(path)
    np.save(tmp_path / "plain.npy", np.zeros(3))
    with pytest.raises(DataError, match=r"plain.npy: not an NPZ file \(no zip signature"):
        load_npz(tmp_path / "plain.npy")


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_safe_unpickler_loads_numpy_arrays_of_every_protocol(protocol):
    from dptrain.data.datasets._safe_pickle import safe_loads

    data = np.arange(12, dtype=np.uint8).reshape(3, 4)
    batch = safe_loads(pickle.dumps({"data": data, b"labels": [1, 2]}, protocol=protocol))
    assert np.array_equal(batch["data"], data) and batch[b"labels"] == [1, 2]
    evil = pickle.dumps(_Exploit(), protocol=protocol)
    with pytest.raises(pickle.UnpicklingError, match="refusing to load global"):
        safe_loads(evil)
