"""Checkpoints that do not pause training: the state is copied to memory at the step, and the
copy is written, fsynced and published in a background thread.

    state = snapshot(live_state)           # CPU copies of every tensor, now
    writer.submit(lambda: commit(state))   # returns at once; waits first for the previous write
    ...
    writer.wait()                          # the run's end: the last write is on disk

`snapshot` copies every tensor because a live `state_dict()` holds the model's own tensors, which
the next steps change in place while the thread is still writing them. At most one write is in
flight: `submit` waits for the previous one, so checkpoints are published in step order and a
slow disk slows the job down instead of piling up copies in memory. An error raised by a write
(a full disk) is raised again by the next `submit` or `wait`, never swallowed. A crash during a
write leaves what a crash during a synchronous write left: the previous checkpoint, valid
(`dptrain.train.checkpoint` publishes by renaming a complete folder).
"""

from __future__ import annotations

import copy
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def snapshot(obj: T) -> T:
    """`obj` with every tensor in it replaced by a CPU copy (dicts, lists and tuples walked;
    a dict keeps its type and attributes, such as a state_dict's `_metadata`)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)  # type: ignore[return-value]
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for key, value in obj.items():
            out[key] = snapshot(value)
        return out
    if type(obj) in (list, tuple):
        return type(obj)(snapshot(v) for v in obj)  # type: ignore[return-value]
    return copy.deepcopy(obj)


class BackgroundWriter:
    """Runs one write at a time in a thread of its own (inline when `enabled` is False).

    The thread lives as long as the writer and takes its writes from a queue: starting a
    thread per checkpoint would cost the training thread a handshake (a GIL switch interval,
    5 ms) at every save.
    """

    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self._jobs: queue.SimpleQueue[Callable[[], Any] | None] = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    def submit(self, write: Callable[[], Any]) -> None:
        """Wait for the write in flight (raising its error), then start `write`."""
        self.wait()
        if not self.enabled:
            write()
            return
        if self._thread is None:
            # A daemon: a process that ends without waiting (a crash, os._exit) must not hang
            # on it; the folder it leaves unpublished is skipped on resume.
            self._thread = threading.Thread(target=self._run, name="dptrain-checkpoint",
                                            daemon=True)
            self._thread.start()
        self._idle.clear()
        self._jobs.put(write)

    def _run(self) -> None:
        while True:
            write = self._jobs.get()
            if write is None:
                return
            try:
                write()
            except BaseException as err:  # noqa: BLE001 - handed to the training thread
                self._error = err
            finally:
                self._idle.set()

    def wait(self) -> None:
        """Block until the write in flight is done; raise its error if it failed."""
        self._idle.wait()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """End the thread once the write in flight is done (its error is not raised here: call
        `wait` first for that). A later `submit` starts a new one."""
        self._idle.wait()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
