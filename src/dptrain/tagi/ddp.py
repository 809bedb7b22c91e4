"""DDPSequential: data-parallel TAGI by all-reducing the parameter deltas before `step()`.

    from dptrain.tagi import Linear, ReLU, Sequential
    from dptrain.tagi.ddp import DDPConfig, DDPSequential
    config = DDPConfig.from_env(backend="gloo")        # or DDPConfig([...], "nccl", rank, world)
    net = DDPSequential(Sequential(Linear(1, 16), ReLU(), Linear(16, 2)), config)
    mu, var = net(x_local)                             # each rank: its own shard of the batch
    updater.update(net.output_z_buffer, y_local, var_y, net.input_delta_z_buffer)
    net.backward(); net.step()                         # all-reduce of the deltas, capped update

Sum mode (`average=False`, the default here) applies `Σ_r Δ_r`, the deltas of the whole global
batch, with the step cap of the global batch size, and (by default) every BatchNorm layer
normalises with the statistics of the global batch: N ranks x batch B step exactly like one
process on N·B (docs/tagi.md, Data-parallel TAGI; docs/design.md, contract 1), uneven local
batches included, and a rank with no sample in a step (an empty batch: it still runs the step,
contributes zero deltas and a BatchNorm count of 0, and so takes part in every collective). It is
the default because it is the Bayesian update the data asks for; averaging shrinks every update
N-fold, as if each step saw only one rank's share of the data.

Average mode (`average=True`, pytagi's default) applies `(1/N) Σ_r Δ_r` with the cap
c(⌊B_global/N⌋) (c(1) when B_global < N) on every rank, and BatchNorm uses each rank's local statistics: pytagi's
`DDPSequential` semantics (docs/tagi.md, Data-parallel TAGI) when the shards are even. pytagi caps with
each rank's own local batch size; with uneven shards on either side of a cap threshold (1 vs
2, 255 vs 256) that makes the replicas drift apart, so here every rank uses the same cap. N is
`average_over`, the world size unless set: a run resumed on another number of ranks keeps the N
it started with, so its steps stay those of the run (docs/tagi.md, Data-parallel TAGI).

BatchNorm (`sync_batchnorm`): with True, each BatchNorm computes its training statistics over
the global batch: one small all-gather of every rank's (count, mean, sum of squared deviations
+ Σ v) per layer per training forward, pooled exactly (`norm.combine_moments`), so the running
statistics are identical everywhere without further communication. With False (pytagi), each
rank normalises with its local statistics and the running statistics are averaged over the
ranks after every step, riding in the delta all-reduce. The default is True in sum mode and
False in average mode; True with `average=True` is allowed (global statistics, averaged deltas),
a combination pytagi does not have.

Overlap (`overlap=True`; off by default): the deltas are all-reduced in buckets of whole
top-level layers (a nested block's leaves are contiguous in the flat buffer, so each layer owns
one contiguous slice). `backward()` finishes the layers from the output side; as soon as a
bucket's layers are done, their deltas are scaled (g → Δ) and the bucket's all-reduce starts
asynchronously while the layers nearer the input still compute. `step()` waits for every
bucket, then steps. The last bucket (the input side) also carries the local batch size and,
without synchronised BatchNorm, the running statistics. The sums are the same element by
element as with one bucket, so the result does not depend on the bucketing (bitwise for 2
ranks). With `overlap=False` (the default) one all-reduce of everything runs inside `step()`;
overlap is opt-in until a machine shows it paying (measurements: bench/README.md, tagi_ddp).
Deltas edited in place between `backward()` and `step()` need `overlap=False`: with overlap
they are already on their way.

The only tagi module that imports `dptrain.runtime` (`dptrain.tagi` itself does not re-export
it): layers never see the process group.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import torch

from dptrain import runtime as dd
from dptrain.runtime import DDPConfig
from dptrain.runtime.collectives import guarded
from dptrain.errors import ConfigError, RankFailure
from dptrain.tagi.compiled import CompiledStep
from dptrain.tagi.norm import BatchNorm2d
from dptrain.tagi.sequential import Sequential


def _start_group(config: DDPConfig) -> None:
    """Start the default process group for `config` unless one is running (or world is 1)."""
    if dd.is_initialized() or config.world_size == 1:
        return
    env = dd.resolve_env()
    if (env.rank, env.world_size) != (config.rank, config.world_size):
        raise ConfigError(f"DDPConfig says rank {config.rank} of {config.world_size} but the "
                          f"launcher ({env.launcher}) says rank {env.rank} of {env.world_size}; "
                          f"use DDPConfig.from_env() or start the process group yourself")
    dd.init_distributed(env, backend=config.backend)  # shut down at exit, see there


def _structure(model: Sequential) -> list[tuple[str, tuple[int, ...]]]:
    return [(name, tuple(t.shape)) for name, t in
            model.named_parameter_tensors() + model.named_state_tensors()]


def _fingerprint(tensor: torch.Tensor) -> str:
    flat = tensor.detach().cpu().contiguous()
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


def _gather_stats(local: torch.Tensor) -> torch.Tensor:
    """(K,) → (world, K): every rank's BatchNorm statistics, in rank order."""
    parts = [torch.empty_like(local) for _ in range(dd.get_world_size())]
    guarded("all_gather(BatchNorm statistics)", local.numel(),
            lambda: torch.distributed.all_gather(parts, local))
    return torch.stack(parts)


DEFAULT_BUCKET_BYTES = 256 * 1024
"""A bucket of deltas is sent once it holds at least this many bytes (whole top-level layers,
from the output side). Each collective has a fixed cost, so a much smaller bucket costs more
than it can hide; torch DDP's 25 MB would hold any of our benchmark networks in one bucket. How
this value was chosen: bench/README.md, tagi_ddp."""


class _Bucket:
    """Columns [start, end) of the (2, P) deltas, reduced as one collective over
    `size` elements of the reducer's buffer from `offset` on."""

    __slots__ = ("start", "end", "offset", "size", "work")

    def __init__(self, start: int, end: int, offset: int, size: int) -> None:
        self.start, self.end, self.offset, self.size = start, end, offset, size
        self.work: Any = None


def _plan(columns: list[tuple[int, int]], bucket_elements: int | None) -> list[tuple[int, int]]:
    """Buckets of whole top-level layers, from the output side: a bucket closes once it holds
    `bucket_elements` columns or more; the last one starts at column 0 (it is always there, as
    it carries the batch size). None: one bucket for everything."""
    total = columns[-1][1] if columns else 0
    if bucket_elements is None:
        return [(0, total)]
    buckets, end = [], total
    for start, stop in reversed(columns):
        if stop > start and start > 0 and end - start >= bucket_elements:
            buckets.append((start, end))
            end = start
    return buckets + [(0, end)]


class _DeltaReducer:
    """Sums the model's `flat_deltas` over the ranks bucket by bucket with asynchronous
    all-reduces, the last bucket also carrying the local batch size and (`with_state`) the
    running statistics.

    `columns_final(start)` starts every bucket whose columns all lie in [start, P); `finish()`
    waits for them in order and copies the sums back.
    Collectives are issued in the same order on every rank because the plan only depends on
    the architecture, which construction checked to be the same everywhere.
    """

    def __init__(self, model: Sequential, with_state: bool, bucket_bytes: int | None,
                 world_size: int) -> None:
        self.model, self.with_state = model, with_state
        self.world_size = world_size
        row_bytes = 2 * model.dtype.itemsize  # one column: its mean and variance delta
        plan = _plan(model.layer_delta_columns(),
                     None if bucket_bytes is None else -(-bucket_bytes // row_bytes))
        extra = (model.flat_state.numel() if with_state else 0) + 1
        self.buckets, offset = [], 0
        for i, (start, end) in enumerate(plan):
            size = 2 * (end - start) + (extra if i == len(plan) - 1 else 0)
            self.buckets.append(_Bucket(start, end, offset, size))
            offset += size
        self._size = offset
        self._buffer: torch.Tensor | None = None
        self._next = 0  # buckets started this step
        self.num_collectives = 0
        self.comm_seconds = 0.0

    def _op(self, i: int) -> str:
        return f"all_reduce(tagi deltas, bucket {i + 1} of {len(self.buckets)})"

    def _region(self, bucket: _Bucket) -> torch.Tensor:
        deltas = self.model.flat_deltas
        buf = self._buffer
        if buf is None or buf.device != deltas.device or buf.dtype != deltas.dtype:
            buf = self._buffer = deltas.new_empty(self._size)  # reused every step
        return buf[bucket.offset:bucket.offset + bucket.size]

    def columns_final(self, start: int) -> None:
        """Columns [start, P) of the deltas hold their final local values: send what fits."""
        while self._next < len(self.buckets) and self.buckets[self._next].start >= start:
            self._launch(self._next)
            self._next += 1

    def _launch(self, i: int) -> None:
        bucket = self.buckets[i]
        region, n = self._region(bucket), bucket.end - bucket.start
        region[:2 * n].view(2, n).copy_(self.model.flat_deltas[:, bucket.start:bucket.end])
        if i == len(self.buckets) - 1:
            if self.with_state:
                region[2 * n:-1].copy_(self.model.flat_state)
            region[-1] = self.model.last_batch_size  # exact in float32 up to 2**24 samples
        began = time.perf_counter()
        bucket.work = guarded(self._op(i), bucket.size,
                              lambda: torch.distributed.all_reduce(region, async_op=True))
        self.comm_seconds += time.perf_counter() - began
        self.num_collectives += 1

    def _wait(self, i: int) -> None:
        bucket = self.buckets[i]
        began = time.perf_counter()
        try:  # a dead or hung peer surfaces here, after the process group's timeout at most
            guarded(self._op(i), bucket.size, bucket.work.wait)
        finally:
            bucket.work = None
            self.comm_seconds += time.perf_counter() - began

    def finish(self) -> int:
        """Wait for every bucket, write the sums into the deltas and, without synchronised
        BatchNorm, the mean running statistics into the state; returns the global batch size."""
        assert self._next == len(self.buckets), "finish() before every bucket was started"
        self._next = 0
        deltas = self.model.flat_deltas
        for i, bucket in enumerate(self.buckets):
            self._wait(i)
            n = bucket.end - bucket.start
            deltas[:, bucket.start:bucket.end].copy_(self._region(bucket)[:2 * n].view(2, n))
        last = self.buckets[-1]
        tail = self._region(last)[2 * (last.end - last.start):]
        if self.with_state:
            self.model.flat_state.copy_(tail[:-1].div_(self.world_size))
        return int(tail[-1].item())

    def drain(self) -> None:
        """Wait for (and drop) the buckets of a backward that no step() followed, so the next
        step's collectives pair up with the other ranks' again."""
        for i in range(self._next):
            if self.buckets[i].work is not None:
                self._wait(i)
        self._next = 0


class DDPSequential:
    """A `Sequential` whose deltas are summed (averaged) over the ranks before every step.

    Same loop surface as `Sequential`: call/forward, `output_z_buffer`, `input_delta_z_buffer`,
    backward, step, train, eval, state_dict, load_state_dict, save, load; anything else is
    forwarded to the wrapped model (`ddp.model`).

    Construction is collective: it starts the process group if none is running, moves the model
    to the config's device, checks that every rank built the same architecture, and broadcasts
    every parameter and the running statistics (nested blocks included: they live in the same
    flat buffers) from rank 0.

    `sync_batchnorm`: None (default) = True in sum mode, False in average mode; see the module
    docstring. `average_over`: the N of average mode's `(1/N) Σ_r Δ_r` and cap c(⌊B_global/N⌋),
    default the world size; a resumed run passes (or sets) the N it started with. `overlap`
    (default False): all-reduce bucket by bucket during `backward()`; `bucket_bytes`: the size
    at which a bucket is sent (see DEFAULT_BUCKET_BYTES). Neither changes the result. `num_collectives`, `comm_seconds` and `buckets` describe the traffic.
    """

    def __init__(self, model: Sequential, config: DDPConfig, average: bool = False,
                 sync_batchnorm: bool | None = None, overlap: bool = False,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 average_over: int | None = None) -> None:
        if not isinstance(model, Sequential):
            raise TypeError(f"DDPSequential wraps a dptrain.tagi.Sequential, got "
                            f"{type(model).__name__}")
        self.model, self.config, self.average = model, config, average
        self.sync_batchnorm = (not average) if sync_batchnorm is None else bool(sync_batchnorm)
        _start_group(config)
        self.rank, self.world_size = dd.get_rank(), dd.get_world_size()
        if (self.rank, self.world_size) != (config.rank, config.world_size):
            raise ConfigError(f"DDPConfig says rank {config.rank} of {config.world_size} but the "
                              f"process group has rank {self.rank} of {self.world_size}")
        if config.device != model.device:
            model.to(config.device)
        self._check_same_architecture()
        dd.broadcast_tensors([t for t in (model.flat_params, model.flat_state) if t.numel()])
        self._batchnorms = [layer for layer in model.descendants()
                            if isinstance(layer, BatchNorm2d)]
        if bucket_bytes < 1:
            raise ConfigError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.overlap, self.bucket_bytes = overlap, bucket_bytes
        self.average_over = self.world_size if average_over is None else average_over
        if not isinstance(self.average_over, int) or self.average_over < 1:
            raise ConfigError(f"average_over must be an int >= 1, got {average_over!r}")
        self.global_batch_size: int | None = None
        self._reducer = None if self.world_size == 1 else _DeltaReducer(
            model, with_state=not self.sync_batchnorm,
            bucket_bytes=bucket_bytes if overlap else None, world_size=self.world_size)

    # -------------------------------------------------------------------------- the loop
    def forward(self, mu_x: Any, var_x: Any = None) -> Any:
        """The model's forward; with synchronised BatchNorm a training forward is collective
        (one all-gather per BatchNorm layer). A training batch may be empty on some ranks (not
        on all): such a rank runs the step all the same and contributes nothing."""
        if not (self.world_size > 1 and self.model.training):
            return self.model(mu_x, var_x)
        gather = self.sync_batchnorm and self._batchnorms
        # Scoped to this call: the model used on its own later normalises locally and refuses
        # an empty batch.
        for layer in self._batchnorms if gather else ():
            layer.stats_gather = _gather_stats
        self.model.allow_empty_batch = True
        try:
            return self.model(mu_x, var_x)
        finally:
            self.model.allow_empty_batch = False
            for layer in self._batchnorms if gather else ():
                layer.stats_gather = None

    __call__ = forward

    def backward(self) -> None:
        """The model's backward; with overlap, each bucket's all-reduce starts as soon as the
        layers it holds are done, while the layers nearer the input still compute."""
        if not (self.overlap and self.world_size > 1):
            self.model.backward()
            return
        self._reducer.drain()  # an earlier backward never followed by step()
        self.model.deltas_ready = self._reducer.columns_final
        try:  # scoped to this call: the model used on its own later scales all at once
            self.model.backward()
        finally:
            self.model.deltas_ready = None
        self._reducer.columns_final(0)  # whatever is left: a network without parameters

    def step(self) -> None:
        """Finish the all-reduce of the deltas (sum or mean), then the capped update."""
        cap = self._reduce_deltas()
        saved, self.model.cap_batch_size = self.model.cap_batch_size, cap
        try:  # scoped to this step: the model used on its own later caps with its own batch
            self.model.step()
        finally:
            self.model.cap_batch_size = saved

    def compile(self, update: str = "plain", backend: str = "inductor",
                mode: str | None = None, native: bool | None = None) -> CompiledStep:
        """The model's step as one compiled program (`Sequential.compile`; `native` as there),
        the all-reduce outside it, between the deltas and the capped step: collectives are
        not traceable. A step the program does not take (another batch shape, an
        uncapturable network) is this wrapper's eager loop, so every rank joins the same
        collectives either way."""
        return CompiledStep(self.model, update, backend=backend, mode=mode, native=native,
                            reduce=self._reduce_deltas, eager=self)

    def _reduce_deltas(self) -> int:
        """The all-reduce of the deltas (sum, or mean); returns the batch size of the cap."""
        local_batch = self.model.last_batch_size
        if local_batch is None:
            raise RuntimeError("step() needs a forward in training mode first")
        if self.world_size > 1:
            # Without an overlapped backward (overlap off, or the model's own backward was
            # called) the reduction starts here, whole.
            self._reducer.columns_final(0)
            self.global_batch_size = self._reducer.finish()
        else:
            self.global_batch_size = local_batch
        if self.global_batch_size < 1:
            raise ValueError(f"step(): every one of the {self.world_size} rank(s) passed an "
                             f"empty batch; a step needs at least one sample")
        if self.average and self.average_over > 1:
            # gloo has no AVG op; dividing the sum keeps the ranks bit-identical
            self.model.flat_deltas.div_(self.average_over)
        # Sum mode caps with the global batch (equivalence); average mode with the mean local
        # batch, the same on every rank (pytagi's local cap when the shards are even), at least
        # 1 for a last batch with fewer samples than N.
        return max(1, self.global_batch_size // self.average_over) if self.average else \
            self.global_batch_size

    @property
    def num_collectives(self) -> int:
        """All-reduce calls issued for the deltas so far (one per bucket per step)."""
        return self._reducer.num_collectives if self._reducer else 0

    @property
    def comm_seconds(self) -> float:
        """Wall time this rank was blocked on the delta all-reduce: starting it and waiting for
        it, waiting for a slower rank included; communication hidden behind the backward is
        not counted."""
        return self._reducer.comm_seconds if self._reducer else 0.0

    @property
    def buckets(self) -> list[tuple[int, int]]:
        """[start, end) columns of `flat_deltas` of each bucket, in the order they are
        reduced (from the output side); the last one also carries the batch size and, without
        synchronised BatchNorm, the running statistics."""
        return [(b.start, b.end) for b in self._reducer.buckets] if self._reducer else []

    # ------------------------------------------------------------------ replica checks
    def _check_same_architecture(self) -> None:
        mine = _structure(self.model)
        everyone = dd.all_gather_object((len(mine), mine, str(self.model.dtype)))
        for rank, theirs in enumerate(everyone):
            if theirs != everyone[0]:
                count0, count = everyone[0][0], theirs[0]
                diff = next(((a, b) for a, b in zip(everyone[0][1], theirs[1]) if a != b), None)
                raise ConfigError(
                    f"rank {rank} built a different model than rank 0: {count} parameter "
                    f"tensors vs {count0}, dtype {theirs[2]} vs {everyone[0][2]}"
                    + (f"; first difference: rank 0 {diff[0]} vs rank {rank} {diff[1]}"
                       if diff else ""))

    def params_fingerprint(self) -> str:
        """Hash of the parameters (means and variances), bitwise."""
        return _fingerprint(self.model.flat_params)

    def state_fingerprint(self) -> str:
        """Hash of the non-parameter state (BatchNorm running statistics), bitwise."""
        return _fingerprint(self.model.flat_state)

    def check_replicas(self) -> None:
        """Raise `RankFailure` naming every rank whose parameters or running statistics differ
        from rank 0's, bitwise.

        Costs one hash of each flat buffer and one small all-gather.
        """
        prints = dd.all_gather_object((self.params_fingerprint(), self.state_fingerprint()))
        problems = []
        for what, i in (("parameters", 0), ("running statistics (BatchNorm state)", 1)):
            diverged = [r for r, p in enumerate(prints) if p[i] != prints[0][i]]
            if diverged:
                problems.append(f"rank(s) {diverged} hold {what} that differ from rank 0's")
        if problems:
            raise RankFailure("replicas diverged: " + "; ".join(problems))

    # --------------------------------------------------------------------- delegation
    def barrier(self) -> None:
        dd.barrier()

    def train(self, mode: bool = True) -> DDPSequential:
        self.model.train(mode)
        return self

    def eval(self) -> DDPSequential:
        self.model.eval()
        return self

    @property
    def output_z_buffer(self):
        return self.model.output_z_buffer

    @property
    def input_delta_z_buffer(self):
        return self.model.input_delta_z_buffer

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not found on the wrapper itself.
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)

    def __repr__(self) -> str:
        mode = "average" if self.average else "sum"
        if self._batchnorms:
            mode += ", sync_batchnorm" if self.sync_batchnorm else ", local batchnorm"
        return f"DDPSequential({self.model!r}, {mode}, rank {self.rank}/{self.world_size})"
