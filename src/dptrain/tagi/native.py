"""The compiled step of LSTM, Linear and ReLU stacks (and an EvenExp head) as a small native
library (docs/tagi.md, Compiled step).

At pytagi's forecasting batches (an LSTM at batch 5) a whole step is ~70,000 multiply-adds;
the code inductor generates for it runs them in ~30 µs but spends twice that allocating its
buffers and passing through its Python wrappers. `native_step.c` does the same math as plain
loops over buffers allocated once, called through ctypes with pointers fixed per network.
A Linear layer's larger products (pytagi's MNIST FNN at batch 32) go to the BLAS library
torch links, called from inside the step (`blas`).

The library is built at first use with the C compiler the machine has (`$CC` where set, else
Python's, else `cc`), no torch headers (a second or two), and cached under
`$DPTRAIN_NATIVE_CACHE` (default `~/.cache/dptrain/native`) by a hash of the source, the
compiler, its flags and the CPU: ranks and restarts reuse it, and a cache on a filesystem
shared by unlike machines keeps one build per kind of CPU. Each build is written under a
temporary name in the cache's own directory and renamed into place, so ranks building into
one empty cache at once only ever load a whole file. A cache directory that cannot be made or
written is replaced by one under the machine's temporary directory (one line); without a
compiler, or where the build fails, `library()` says why and the compiled step uses inductor's
program instead (one line, where the step is made).

Ranks on CPUs of different kinds build for their own instruction sets (`-march=native`) and
must still keep bit-identical replicas. What every rank computes alike, the capped step of the
all-reduced deltas (`capped_step`), is single IEEE operations (a square root, products,
comparisons, sums) with no reductions and no libm call, and no product in it feeds a sum (a
clamp stands between), so no compiler can fuse one into a multiply-add where the CPU has them:
its result is the same bit for bit whatever the instruction set. Each rank's own forward and
deltas may differ in the last bits between CPU kinds (fused multiply-adds, the width of the
vectorised sums, libm's per-CPU code), as torch's own kernels do; they reach the parameters
only through the all-reduce, whose sum every rank receives alike.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dptrain.tagi._inputs import as_input
from dptrain.tagi.activations import EvenExp, ReLU
from dptrain.tagi.base import VAR_FLOOR
from dptrain.tagi.linear import Linear
from dptrain.tagi.lstm import LSTM
from dptrain.tagi.output_updater import _indices

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_step.c")
#: -march=native where the compiler takes it (the cache key holds the CPU's flags). Fused
#: multiply-adds stay allowed (12 % of the LSTM example's step at batch 256): the capped step,
#: which every rank must round alike, has no product that feeds a sum (native_step.c, capped)
FLAGS = ("-O3", "-fPIC", "-fopenmp-simd", "-fno-trapping-math", "-fno-math-errno",
         "-march=native")
#: flags added after FLAGS (e.g. -march=x86-64: one instruction set for unlike machines), and
#: part of the cache key
EXTRA_FLAGS_ENV = "DPTRAIN_NATIVE_FLAGS"
_KINDS = {Linear: 1, LSTM: 2, ReLU: 3, EvenExp: 4}
_ACTIVATIONS = (ReLU, EvenExp)
_WORDS, _HEAD = 8, 11  # the plan's words per layer and before the layers (native_step.c)
_REALS = {torch.float32: (ctypes.c_float, "_f32"), torch.float64: (ctypes.c_double, "_f64")}

#: A Linear layer's products go to the BLAS library from this many multiply-adds (batch x
#: inputs x outputs) on: below it a call's own overhead is most of a product's time (the
#: LSTM example's Linear(40, 1) at batch 5 is 200).
BLAS_MACS = 16384

#: A step of at most this many parameters x batch size keeps its BLAS products on its own
#: thread (with MKL), above it they run on torch's threads. On 2 threads, pytagi's FNN
#: (118k parameters) stepped in 315 µs pinned against 355 at batch 32 (the capped step then
#: reads the deltas the other core wrote), the same at 64, 940 against 725 at 128.
ONE_THREAD_WORK = 5_000_000

#: the output updates the native step does (CompiledStep's names), as native_step.c numbers them
UPDATES = ("plain", "indices", "heteros")

_loaded: tuple[ctypes.CDLL | None, str | None] | None = None
_gemms: dict[torch.dtype, int] = {}  # the BLAS product per dtype (0: none)
_threads_local: int | None = None  # MKL_Set_Num_Threads_Local (0: none)


class NotNative(Exception):
    """The network, or this step, is not one the native step does; the message says why."""


def library() -> ctypes.CDLL:
    """The built library, loaded once per process; NotNative says why it cannot be."""
    global _loaded
    if _loaded is None:
        try:
            _loaded = (ctypes.CDLL(str(_build())), None)
        except (OSError, subprocess.SubprocessError) as err:
            first = next((line for line in str(err).splitlines() if line.strip()), repr(err))
            _loaded = (None, f"the native step could not be built: {first}")
    lib, why = _loaded
    if lib is None:
        raise NotNative(why)
    return lib


def blas(dtype: torch.dtype) -> int:
    """The address of the Fortran BLAS product (sgemm_/dgemm_) that torch's own library
    exports, or 0 where it exports none or the one it exports fails a 2 x 2 product (the
    step then does every product as loops). Found once per dtype."""
    if dtype not in _gemms:
        _gemms[dtype] = _find_gemm(dtype)
        if not _gemms[dtype]:
            log.info("native: torch exports no usable BLAS %s; products run as loops",
                     "sgemm_" if dtype == torch.float32 else "dgemm_")
    return _gemms[dtype]


def blas_threads_local() -> int:
    """The address of MKL's MKL_Set_Num_Threads_Local in torch's library (0: none), through
    which a small step keeps its products on its own thread (ONE_THREAD_WORK)."""
    global _threads_local
    if _threads_local is None:
        _threads_local = next(_torch_symbols("MKL_Set_Num_Threads_Local"), 0)
    return _threads_local


def _torch_symbols(name: str) -> Iterator[int]:
    """The addresses of `name` in torch's own library, then in the process's global ones."""
    lib_dir = Path(torch.__file__).parent / "lib"
    for path in (*sorted(lib_dir.glob("libtorch_cpu.*")), None):
        try:
            address = ctypes.cast(getattr(ctypes.CDLL(str(path) if path else None), name),
                                  ctypes.c_void_p).value
        except (OSError, AttributeError):
            continue
        if address:
            yield address


def _find_gemm(dtype: torch.dtype) -> int:
    name = "sgemm_" if dtype == torch.float32 else "dgemm_"
    return next((address for address in _torch_symbols(name) if _gemm_works(address, dtype)),
                0)


def _gemm_works(address: int, dtype: torch.dtype) -> bool:
    """Whether `address` computes a known row-major A Bᵀ through the step's own call."""
    a = torch.arange(1.0, 7.0, dtype=dtype).view(2, 3)
    b = torch.tensor([[1.0, 0.0, -1.0], [2.0, 0.5, 0.25]], dtype=dtype)
    c = torch.full((2, 2), float("nan"), dtype=dtype)
    probe = getattr(library(), f"gemm_probe{_REALS[dtype][1]}")
    probe.restype = None
    probe.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    probe(address, a.data_ptr(), b.data_ptr(), c.data_ptr())
    return bool(torch.equal(c, a @ b.t()))


def _compiler() -> str:
    """$CC where set (not found: an error, not another compiler in its place), else Python's
    compiler, `cc` or `gcc`."""
    chosen = os.environ.get("CC", "").strip()
    if chosen:
        path = shutil.which(shlex.split(chosen)[0])
        if path is None:
            raise OSError(f"the compiler CC={chosen} is not found")
        return path
    python_cc = (sysconfig.get_config_var("CC") or "").split()[:1]  # e.g. "gcc -pthread"
    for name in (*python_cc, "cc", "gcc"):
        path = shutil.which(name)
        if path:
            return path
    raise OSError("no C compiler found (set CC)")


def _cpu() -> str:
    """What -march=native compiles for: the machine and its CPU's feature flags."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()} {flags}"


def cache_dir() -> Path:
    root = os.environ.get("DPTRAIN_NATIVE_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dptrain" / "native"


def _build() -> Path:
    """The library's path, built unless the cache has it. Written under a temporary name
    and renamed into place, so ranks building at once never load a partial file."""
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    flags = [*FLAGS, *shlex.split(os.environ.get(EXTRA_FLAGS_ENV, ""))]
    key = hashlib.sha256("\0".join([SOURCE.read_text(), version, " ".join(flags), _cpu()])
                         .encode()).hexdigest()[:20]
    target = cache_dir() / f"tagi_step-{key}.so"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # a file made and removed: file modes alone do not say it (root writes through them,
        # a read-only filesystem refuses everyone)
        probe, name = tempfile.mkstemp(dir=target.parent, prefix=".probe-")
        os.close(probe)
        os.unlink(name)
    except OSError:  # a read-only home: this machine's temporary directory, per user
        fallback = Path(tempfile.gettempdir()) / f"dptrain-native-{os.getuid()}"
        log.warning("native: the cache %s cannot be written; building in %s", target.parent,
                    fallback)
        target = fallback / target.name
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = []
        for real, suffix in (("float", "_f32"), ("double", "_f64")):
            obj = Path(tmp) / f"step{suffix}.o"
            _run_compiler([cc, *flags, f"-DREAL={real}", f"-DSUFFIX={suffix}",
                           f"-DREAL_IS_{real.upper()}", "-c", str(SOURCE), "-o", str(obj)],
                          flags)
            objects.append(str(obj))
        partial = Path(tmp) / target.name
        _run_compiler([cc, "-shared", *objects, "-o", str(partial), "-lm"], [])
        os.replace(partial, target)
    log.debug("native: built %s", target)
    return target


def _run_compiler(command: list[str], flags: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if done.returncode and "-march=native" in flags:  # a compiler without it: plain -O3
        flags.remove("-march=native")
        command = [arg for arg in command if arg != "-march=native"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise OSError(f"{' '.join(command[:2])} failed: {done.stderr.strip()[:500]}")


def check_network(net: Any, update: str = "plain") -> None:
    """NotNative unless `net` is a CPU stack of LSTM, Linear and ReLU layers the native step
    does with this output update: a ReLU after a Linear, followed by a Linear or last; an
    EvenExp after a Linear, last; for the heteroscedastic update an even output width."""
    if update not in UPDATES:
        raise NotNative(f"the native step does the {', '.join(UPDATES)} updates, not "
                        f"{update!r}")
    layers = list(net.layers)
    if net.device.type != "cpu":
        raise NotNative(f"the native step runs on the CPU, the network is on {net.device}")
    if net.dtype not in _REALS:
        raise NotNative(f"the native step takes float32 and float64, not {net.dtype}")
    kinds = [type(layer) for layer in layers]
    if not layers or any(kind not in _KINDS for kind in kinds) or \
            list(net.descendants()) != layers:
        names = ", ".join(sorted({kind.__name__ for kind in kinds} - set(
            k.__name__ for k in _KINDS)))
        raise NotNative(f"the native step takes stacks of LSTM, Linear, ReLU and EvenExp "
                        f"layers only{' (not ' + names + ')' if names else ''}")
    if any(getattr(layer, "per_position", False) for layer in layers):
        raise NotNative("the native step does not take per-position Linear layers")
    for before, layer, after in zip([None, *kinds], kinds, [*kinds[1:], None]):
        if layer is ReLU and (before is not Linear or after not in (Linear, None)):
            raise NotNative("the native step takes a ReLU only between Linear layers or "
                            "after the last")
        if layer is EvenExp and (before is not Linear or after is not None):
            raise NotNative("the native step takes an EvenExp only after the last Linear")
    if net.input_state_update:
        raise NotNative("the native step does not compute the input's innovations")
    width = None
    for layer in layers:
        inputs, outputs = _widths(layer, width)
        if width is not None and width != inputs:
            raise NotNative(f"{layer.label} takes {inputs} values per sample, the layer "
                            f"before gives {width}")
        width = outputs
    if update == "heteros" and (kinds[-1] is LSTM or width % 2):
        raise NotNative("the heteroscedastic update needs (mean, noise) pairs: a (batch, "
                        "even width) output")


def not_native(net: Any, update: str = "plain") -> str | None:
    """Why `net` would not be stepped natively with this output update (None: it would, the
    library built or loaded here)."""
    try:
        check_network(net, update)
        library()
    except NotNative as why:
        return str(why)
    return None


def output_shape(net: Any, batch: int) -> tuple[int, ...] | None:
    """The shape of the eager forward's output for a network the native step does (None for
    any other): (B, T, O) after an LSTM, (B, O) after a Linear or an activation."""
    try:
        check_network(net)
    except NotNative:
        return None
    width = None
    for layer in net.layers:
        width = _widths(layer, width)[1]
    last = net.layers[-1]
    if isinstance(last, LSTM):
        return (batch, last.seq_len, last.output_size)
    return (batch, width)


def loop_work(net: Any, batch: int) -> int:
    """Parameters x batch size of the layers the native step does as its own loops, on one
    thread (the others' products are BLAS calls on torch's threads). NotNative for a network
    it does not do."""
    check_network(net)
    gemm = blas(net.dtype)
    work = 0
    for layer in net.layers:
        if isinstance(layer, Linear) and gemm and \
                batch * layer.input_size * layer.output_size >= BLAS_MACS:
            continue
        work += sum(t.numel() for t in (getattr(layer, name, None) for name in
                                        ("mu_w", "mu_b")) if t is not None)
    return work * batch


def _widths(layer: Any, before: int | None) -> tuple[int, int]:
    """A layer's values per sample in and out (an activation's: the layer before's)."""
    if isinstance(layer, LSTM):
        return layer.seq_len * layer.input_size, layer.seq_len * layer.output_size
    if isinstance(layer, _ACTIVATIONS):
        assert before is not None  # check_network: an activation follows a Linear
        return before, before
    return layer.input_size, layer.output_size


class NativeStep:
    """The step of one network at one batch size: its plan, buffers and pointers, made once.
    `__call__` returns (mu, var) of the output before the update, or None when this step is
    not one it does (an LSTM that starts from states set by `set_lstm_states`): the caller
    then steps eagerly."""

    def __init__(self, net: Any, batch: int, out_shape: tuple[int, ...] | None = None,
                 update: str = "plain") -> None:
        """`out_shape`: the output's shape, as the eager forward gives it (default (B, width
        of the last layer)). `update`: one of UPDATES, the output update of every step."""
        check_network(net, update)
        self.update = UPDATES.index(update)
        lib = library()
        self.net, self.batch = net, batch
        self.lstms = [layer for layer in net.layers if isinstance(layer, LSTM)]
        if any(layer.seq_len == 1 for layer in self.lstms) and batch == 1:
            raise NotNative("an LSTM carrying its states (seq_len 1, batch 1) is stepped by "
                            "the traced program")
        real, suffix = _REALS[net.dtype]
        self.fn = getattr(lib, f"tagi_step{suffix}")
        self.fn.restype = ctypes.c_int
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self.fn.argtypes = [p, p, ctypes.c_int, ctypes.c_int, p, p, i64, p, i64, ctypes.c_int,
                            real, real, real, p, p]
        self.params, self.deltas = net.flat_params, net.flat_deltas
        count = self.params.shape[1]
        for t in (self.params, self.deltas):
            if not t.is_contiguous():
                raise NotNative("the parameter pack is not one contiguous (2, P) buffer")
        layers, scratch, widest, width = [], 0, 1, None
        for layer in net.layers:
            inputs, outputs = _widths(layer, width)
            width = outputs
            widest = max(widest, inputs, outputs)
            size = 2 * batch * outputs  # native_step.c, the plan's comment
            if isinstance(layer, _ACTIVATIONS):
                layers += [_KINDS[type(layer)], inputs, outputs, 1, 0, -1, -1, scratch]
                scratch += size + batch * outputs
                continue
            if isinstance(layer, LSTM):
                i, o = layer.input_size, layer.output_size
                size += 3 * batch * outputs + (12 * i * o + 3 * i * o) + 6 * i * o + 12 * o
            else:
                size += batch * inputs + 2 * inputs * outputs
            layers += [_KINDS[type(layer)], layer.input_size, layer.output_size,
                      getattr(layer, "seq_len", 1), int(layer.bias),
                      self._offset(layer.mu_w, layer.var_w, count),
                      self._offset(layer.mu_b, layer.var_b, count) if layer.bias else -1,
                      scratch]
            scratch += size
        self.out_shape = tuple(out_shape) if out_shape is not None else (batch, outputs)
        like = {"dtype": net.dtype, "device": net.device}
        self.work = torch.empty(scratch, **like)
        self.grad = torch.empty(4 * batch * widest, **like)
        head = [len(net.layers), batch, count, self.params.data_ptr(), self.deltas.data_ptr(),
                self.work.data_ptr(), self.grad.data_ptr(), widest, blas(net.dtype), BLAS_MACS,
                blas_threads_local() if count * batch <= ONE_THREAD_WORK else 0]
        self.plan = torch.tensor(head + layers, dtype=torch.int64)
        self.plan_ptr = self.plan.data_ptr()
        self.capped_step = getattr(lib, f"capped_step{suffix}")
        self.capped_step.restype = None
        self.capped_step.argtypes = [p, real, real, real]
        self.forward_fn = getattr(lib, f"tagi_forward{suffix}")
        self.forward_fn.restype = ctypes.c_int
        self.forward_fn.argtypes = [p, p, ctypes.c_int, p, p]

    def _offset(self, mu: torch.Tensor, var: torch.Tensor, count: int) -> int:
        """Where a layer's parameter group starts in the parameter rows (checked to be the
        pack's storage: a group rebound elsewhere is not the native step's)."""
        size = self.params.element_size()
        start = (mu.data_ptr() - self.params.data_ptr()) // size
        if not (mu.is_contiguous() and var.is_contiguous() and 0 <= start < count and
                var.data_ptr() == mu.data_ptr() + count * size and
                self.deltas.shape == self.params.shape):
            raise NotNative("a layer's parameters are not views of the network's pack")
        return start

    def current(self) -> bool:
        """Whether the network still has the pack this step was planned for (`to()` makes a
        new one)."""
        net = self.net
        return net.flat_params is self.params and net.flat_deltas is self.deltas

    def __call__(self, x: torch.Tensor, y: torch.Tensor, noise: torch.Tensor,
                 factor: float | None, check_x: bool = False,
                 idx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`factor`: the cap's c, or None to leave the capped step to the caller (data
        parallel: Δ is all-reduced first). `check_x`: check that x is finite, as the eager
        forward does (`as_input`), inside the call: a ValueError, and nothing written, if not.
        `idx`: with the indexed update, the 1-based observed outputs, (B, L) int64
        (update_using_indices, `y` and `noise` of its shape; their range is checked inside the
        call, a ValueError and nothing written if one is out of it). The heteroscedastic
        update reads `y` (B, half the output width) and not `noise`."""
        if not self._zero_states(x):
            return None
        x, y = x.contiguous(), y.contiguous()
        noise_stride = 0 if noise.numel() == 1 else 1
        if noise_stride:
            noise = noise.expand(y.shape).contiguous()
        obs, idx_ptr = 0, None
        if idx is not None:
            idx = idx.to(torch.int64).contiguous()
            obs, idx_ptr = idx.shape[1], idx.data_ptr()
        mu = torch.empty(self.out_shape, dtype=y.dtype)
        var = torch.empty(self.out_shape, dtype=y.dtype)
        lo, hi = (-1.0 / factor, 1.0 / factor) if factor is not None else (0.0, 0.0)
        args = (x.data_ptr(), y.data_ptr(), idx_ptr, obs, noise.data_ptr(), noise_stride,
                int(factor is not None), lo, hi, VAR_FLOOR, mu.data_ptr(), var.data_ptr())
        failed = self.fn(self.plan_ptr, args[0], int(check_x), self.update, *args[1:])
        if failed == 2:  # an index out of range: the eager check raises, saying which
            _indices(idx, mu)
        elif failed:
            # the sum is not finite: the eager check finds the value and says where (or,
            # for a finite sum that overflowed, passes, and the step runs unchecked)
            as_input(x, None, x.dtype, x.device, True, allow_empty=True)
            self.fn(self.plan_ptr, args[0], 0, self.update, *args[1:])
        # the parameters were written behind torch's back: bump their write counter (the
        # layers' weight caches are keyed on it)
        torch.autograd.graph.increment_version(self.params)
        return mu, var

    def forward(self, x: torch.Tensor, check_x: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The evaluation forward of `x`: (mu, var) of the output, the eager forward's moments,
        nothing stepped (its products on torch's threads). `check_x` and None as `__call__`."""
        if not self._zero_states(x):
            return None
        x = x.contiguous()
        mu = torch.empty(self.out_shape, dtype=self.params.dtype)
        var = torch.empty(self.out_shape, dtype=self.params.dtype)
        if self.forward_fn(self.plan_ptr, x.data_ptr(), int(check_x), mu.data_ptr(),
                           var.data_ptr()):
            as_input(x, None, x.dtype, x.device, True, allow_empty=True)
            self.forward_fn(self.plan_ptr, x.data_ptr(), 0, mu.data_ptr(), var.data_ptr())
        return mu, var

    def _zero_states(self, x: torch.Tensor) -> bool:
        """The eager forward's bookkeeping of the LSTMs' previous states; False where one
        starts from states set by `set_lstm_states` (not the native step's)."""
        for layer in self.lstms:
            if layer._batch_size != self.batch or not layer._prev_zero:
                layer._previous_states(self.batch, x)
                if not layer._prev_zero:
                    return False
        return True

    def step(self, factor: float) -> None:
        """The capped step with cap factor c of the deltas a call with `factor=None` left
        (scaled, and all-reduced by the caller since): `Sequential.step()` in one pass."""
        self.capped_step(self.plan_ptr, -1.0 / factor, 1.0 / factor, VAR_FLOOR)
        torch.autograd.graph.increment_version(self.params)
