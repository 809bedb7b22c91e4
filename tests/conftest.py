"""Hygiene for every test: environment restored, no process group left open, seeded torch."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _clean_process_state():
    saved_env = dict(os.environ)
    threads = torch.get_num_threads()
    # One thread: on 2 shared cores a second thread makes every small op wait for the other
    # process (measured: ms-long stalls), and results do not depend on the thread count here.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved_env)
    torch.set_num_threads(threads)
