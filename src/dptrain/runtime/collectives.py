"""Collectives the other layers need, each safe to call without a process group (world of 1).

Every helper must be called by every rank of the group, in the same order, with tensors of the
same shapes: that is what a collective is. A failure inside one (a peer died, raised, or timed
out) is raised as `RankFailure` naming this rank, the operation and its size.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from dptrain.errors import RankFailure

T = TypeVar("T")


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def is_main_process() -> bool:
    return get_rank() == 0


ROLL_CALL_S = 3.0
"""How long a rank whose collective failed waits for the others to report in."""
ROLL_CALL_ENV = "DPTRAIN_ROLL_CALL"
"""Set to "off" by `dptrain run`/`train` for a one-node job: its agent watches every rank and
names the one that died, so a survivor has nothing to wait for and reports at once."""


def _store_reachable(store: Any, timeout_s: float = 1.0) -> bool:
    """Whether the TCP store under `store` (prefixes unwrapped) still accepts a connection:
    False when its host (rank 0, or the node serving the rendezvous) is gone. A store that is
    not a TCPStore is assumed reachable."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        return True
    try:
        socket.create_connection((store.host, store.port), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def _missing_ranks() -> list[int] | None:
    """`_roll_call`, given at most ROLL_CALL_S plus a second: when the store's host vanished
    without closing its sockets (a node lost its network), a store request waits in `recv`
    without any timeout, so it runs in a thread that is abandoned then (None: no answer)."""
    answer: list[list[int] | None] = []
    caller = threading.Thread(target=lambda: answer.append(_roll_call()), daemon=True,
                              name="dptrain-roll-call")
    caller.start()
    caller.join(ROLL_CALL_S + 1.0)
    return answer[0] if answer else None


def _roll_call() -> list[int] | None:
    """After a failed collective: the ranks that do not report in through the rendezvous
    store within ROLL_CALL_S (dead, hung, or still short of the collective), or None when the
    store itself is gone (its host, rank 0, died). Every surviving rank goes through here, so
    each one reports in while it looks for the others."""
    try:
        store = dist.distributed_c10d._get_default_store()
        if not _store_reachable(store):
            return None  # asked anyway, the store's C++ client prints a trace to stderr
        rank, world_size = get_rank(), get_world_size()
        store.set(f"dptrain/alive/{rank}", "1")
        keys = [f"dptrain/alive/{r}" for r in range(world_size)]
        deadline = time.monotonic() + ROLL_CALL_S
        while True:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 - the diagnosis must never mask the original error
        return None


_collective_s = 0.0


def collective_seconds() -> float:
    """Seconds this process has spent inside collectives so far: waiting for the other ranks
    to arrive, plus the transfer itself. The Trainer takes differences of it around a step to
    split the step into compute and waiting (dptrain.train.stragglers); a rank that makes the
    others wait spends the least time here."""
    return _collective_s


def count_collective_seconds(seconds: float) -> None:
    """Add the time of a collective that does not run through `guarded`: one that a library
    runs inside its own call (DDP's gradient all-reduce, waited for at the end of backward)."""
    global _collective_s
    _collective_s += seconds


def guarded(op: str, numel: int, call: Callable[[], T]) -> T:
    """Run a collective; a failure becomes `RankFailure` naming this rank, the operation and,
    when the rendezvous store can tell, the ranks that did not reach it. Its time counts in
    `collective_seconds`."""
    started = time.perf_counter()
    try:
        return call()
    except (RuntimeError, dist.DistError) as err:
        missing = None if os.environ.get(ROLL_CALL_ENV) == "off" else _missing_ranks()
        culprit = (f"rank(s) {missing} did not reach it (no sign of life within "
                   f"{ROLL_CALL_S:g} s): they raised, died or hang elsewhere; their own output "
                   f"names the cause" if missing else
                   "another rank probably raised, died or never reached it; its own output "
                   "names the cause")
        raise RankFailure(
            f"rank {get_rank()} of {get_world_size()}: {op} of {numel} element(s) failed: {err}\n"
            f"HINT: {culprit}", missing=missing or None) from err
    finally:
        count_collective_seconds(time.perf_counter() - started)


def as_rank_failure(err: BaseException) -> BaseException:
    """`err`, or a `RankFailure` for it when it is the communication library's report of a
    lost peer from a collective that torch runs by itself, outside `guarded`: DDP's gradient
    all-reduce in backward, FSDP's all-gather in forward. NCCL's and the store's reports are
    `DistError`s; gloo's are plain RuntimeErrors that cite its transport's source file. Any
    other error (a user's shape mismatch, say) is left as it is."""
    if isinstance(err, RankFailure) or not is_initialized():
        return err
    if not (isinstance(err, dist.DistError) or
            (isinstance(err, RuntimeError) and "gloo/transport" in str(err))):
        return err
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return RankFailure(
        f"rank {get_rank()} of {get_world_size()}: a collective run by torch (DDP or FSDP) "
        f"failed: {first}\nHINT: another rank probably raised, died or never reached it; its "
        f"own output names the cause")


def barrier() -> None:
    """Wait for every rank. On gloo a missing rank is named in the error."""
    if not is_initialized():
        return
    if dist.get_backend() == "gloo":
        guarded("monitored_barrier", 0, lambda: dist.monitored_barrier(wait_all_ranks=True))
    else:
        guarded("barrier", 0, dist.barrier)


def _buckets(tensors: Sequence[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return groups


def _flat_in_place(tensors: Sequence[torch.Tensor], op: str,
                   collective: Callable[[torch.Tensor], Any]) -> int:
    """Run `collective` on one flat buffer per (dtype, device) and copy results back.

    Returns the number of collective calls made (one per bucket).
    """
    calls = 0
    for group in _buckets(tensors).values():
        flat = torch.cat([t.reshape(-1) for t in group])
        guarded(op, flat.numel(), lambda: collective(flat))
        offset = 0
        for t in group:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
        calls += 1
    return calls


def all_reduce_flat(tensors: Sequence[torch.Tensor], *, average: bool = False) -> int:
    """Sum (or average over ranks) `tensors` in place with one all-reduce per dtype and device.

    Returns the number of collective calls made (0 without a process group).
    """
    if not is_initialized() or not tensors:
        return 0
    world_size = get_world_size()

    def reduce(flat: torch.Tensor) -> None:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        if average:
            flat.div_(world_size)  # gloo has no AVG op; dividing once keeps ranks bit-identical

    return _flat_in_place(tensors, "all_reduce", reduce)


def broadcast_tensors(tensors: Sequence[torch.Tensor], *, src: int = 0) -> int:
    """Overwrite `tensors` on every rank with rank `src`'s values, one broadcast per bucket."""
    if not is_initialized() or not tensors:
        return 0
    return _flat_in_place(tensors, "broadcast", lambda flat: dist.broadcast(flat, src=src))


def broadcast_object(obj: T, *, src: int = 0) -> T:
    """Rank `src`'s picklable `obj` on every rank (other ranks' `obj` is ignored)."""
    if not is_initialized():
        return obj
    box = [obj]
    guarded("broadcast_object", 1, lambda: dist.broadcast_object_list(box, src=src))
    return box[0]


def all_gather_object(obj: T) -> list[T]:
    """Every rank's picklable `obj`, in rank order."""
    if not is_initialized():
        return [obj]
    out: list[Any] = [None] * get_world_size()
    guarded("all_gather_object", 1, lambda: dist.all_gather_object(out, obj))
    return out


def reduce_sum_count(metrics: Mapping[str, tuple[float, float]],
                     device: torch.device | str = "cpu") -> dict[str, tuple[float, float]]:
    """Global `(sum, count)` per metric name, summed in float64 over the ranks.

    Means computed from these are exact over all samples, however unevenly the ranks hold them.
    Ranks may pass different names (a rank with no test samples passes none): the result has
    every name any rank passed, a rank without it counting `(0, 0)`. The names are agreed first
    because an all-reduce of buffers of different lengths errors in gloo or hangs.
    """
    if not is_initialized():
        return {name: (float(s), float(c)) for name, (s, c) in sorted(metrics.items())}
    names = sorted(set().union(*all_gather_object(sorted(metrics))))
    values = [float(v) for name in names for v in metrics.get(name, (0.0, 0.0))]
    buf = torch.tensor(values, dtype=torch.float64, device=device)
    guarded("all_reduce(metrics)", buf.numel(), lambda: dist.all_reduce(buf))
    totals = buf.tolist()
    return {name: (totals[2 * i], totals[2 * i + 1]) for i, name in enumerate(names)}


def means(sums_counts: Mapping[str, tuple[float, float]]) -> dict[str, float]:
    """`sum / count` per metric (NaN for a count of zero)."""
    return {k: (s / c if c else float("nan")) for k, (s, c) in sums_counts.items()}
