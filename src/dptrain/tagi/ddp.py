"""DDPSequential: data-parallel TAGI by all-reducing the parameter deltas before `step()`.

    from dptrain.tagi import DDPConfig, DDPSequential, Linear, ReLU, Sequential
    config = DDPConfig.from_env(backend="gloo")        # or DDPConfig([...], "nccl", rank, world)
    net = DDPSequential(Sequential(Linear(1, 16), ReLU(), Linear(16, 2)), config)
    mu, var = net(x_local)                             # each rank: its own shard of the batch
    updater.update(net.output_z_buffer, y_local, var_y, net.input_delta_z_buffer)
    net.backward(); net.step()                         # one all-reduce, then the capped update

Sum mode (`average=False`, the default here) applies `Σ_r Δ_r`, the deltas of the whole global
batch, with the step cap of the global batch size: N ranks x batch B step exactly like one
process on N·B (docs/tagi.md, Data-parallel TAGI; docs/design.md, contract 1). Default: it is the
Bayesian update the data asks for; averaging shrinks every update N-fold, as if each step saw
only one rank's share of the data.

Average mode (`average=True`, pytagi's default) applies `(1/N) Σ_r Δ_r` with the cap of the
*local* batch size, exactly pytagi's `DDPSequential` semantics (docs/tagi.md, Data-parallel TAGI).

The only tagi module that imports `dptrain.dist`: layers never see the process group.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import torch

from dptrain import dist as dd
from dptrain.dist import DDPConfig
from dptrain.dist.collectives import guarded
from dptrain.errors import ConfigError, RankFailure
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
    return [(name, tuple(t.shape)) for name, t in model.named_parameter_tensors()]


class DDPSequential:
    """A `Sequential` whose `step()` first all-reduces every rank's deltas as one flat bucket.

    Same loop surface as `Sequential`: call/forward, `output_z_buffer`, `input_delta_z_buffer`,
    backward, step, train, eval, state_dict, load_state_dict, save, load; anything else is
    forwarded to the wrapped model (`ddp.model`).

    Construction is collective: it starts the process group if none is running, moves the model
    to the config's device, checks that every rank built the same architecture, and broadcasts
    every parameter (nested blocks included: they live in the same flat buffer) from rank 0.
    """

    def __init__(self, model: Sequential, config: DDPConfig, average: bool = False) -> None:
        if not isinstance(model, Sequential):
            raise TypeError(f"DDPSequential wraps a dptrain.tagi.Sequential, got "
                            f"{type(model).__name__}")
        self.model, self.config, self.average = model, config, average
        _start_group(config)
        self.rank, self.world_size = dd.get_rank(), dd.get_world_size()
        if (self.rank, self.world_size) != (config.rank, config.world_size):
            raise ConfigError(f"DDPConfig says rank {config.rank} of {config.world_size} but the "
                              f"process group has rank {self.rank} of {self.world_size}")
        if config.device != model.device:
            model.to(config.device)
        self._check_same_architecture()
        dd.broadcast_tensors([model.flat_params])
        self.num_collectives = 0
        """All-reduce calls issued by step() so far (one per step; tests and benches read it)."""
        self.comm_seconds = 0.0
        """Wall time spent in those all-reduces, waiting for slower ranks included."""
        self.global_batch_size: int | None = None
        self._bucket: torch.Tensor | None = None

    # -------------------------------------------------------------------------- the loop
    def forward(self, mu_x: Any, var_x: Any = None) -> Any:
        return self.model(mu_x, var_x)

    __call__ = forward

    def backward(self) -> None:
        self.model.backward()

    def step(self) -> None:
        """All-reduce the deltas (sum or mean) in one collective, then the capped update."""
        local_batch = self.model.last_batch_size
        if local_batch is None:
            raise RuntimeError("step() needs a forward in training mode first")
        if self.world_size > 1:
            self.global_batch_size = self._all_reduce_deltas(local_batch)
        else:
            self.global_batch_size = local_batch
        # Sum mode caps with the global batch (equivalence); average mode with the local one.
        self.model.cap_batch_size = None if self.average else self.global_batch_size
        self.model.step()

    def _all_reduce_deltas(self, local_batch: int) -> int:
        """One collective carries every delta and the local batch size (for the global cap)."""
        deltas = self.model.flat_deltas  # (2, P)
        bucket = self._bucket
        if bucket is None or bucket.numel() != deltas.numel() + 1 or \
                bucket.device != deltas.device or bucket.dtype != deltas.dtype:
            bucket = self._bucket = deltas.new_empty(deltas.numel() + 1)  # reused every step
        bucket[:-1].copy_(deltas.reshape(-1))
        bucket[-1] = local_batch  # exact in float32 up to 2**24 samples per step
        start = time.perf_counter()
        guarded("all_reduce(tagi deltas)", bucket.numel(),
                lambda: torch.distributed.all_reduce(bucket))
        self.comm_seconds += time.perf_counter() - start
        self.num_collectives += 1
        if self.average:
            bucket[:-1].div_(self.world_size)
        deltas.copy_(bucket[:-1].view_as(deltas))
        return int(bucket[-1].item())

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
        flat = self.model.flat_params.detach().cpu().contiguous()
        return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()

    def check_replicas(self) -> None:
        """Raise `RankFailure` naming every rank whose parameters differ from rank 0's, bitwise.

        Costs one hash of the parameters and one small all-gather.
        """
        prints = dd.all_gather_object(self.params_fingerprint())
        diverged = [r for r, p in enumerate(prints) if p != prints[0]]
        if diverged:
            raise RankFailure(f"replicas diverged: rank(s) {diverged} hold parameters that "
                              f"differ from rank 0's")

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
        return f"DDPSequential({self.model!r}, {mode}, rank {self.rank}/{self.world_size})"
