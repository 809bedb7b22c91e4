"""`RoundWatch` on torch's real dynamic rendezvous (c10d backend, a real TCPStore on the
loopback): two handlers of one process are two nodes of a round. A node whose heartbeats stop
is seen gone once torch drops it; a node waiting to join is not taken for a loss; and the
private parts of torch it reads are still where it reads them (else these fail)."""

from __future__ import annotations

import contextlib
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (DynamicRendezvousHandler,
                                                                     RendezvousTimeout)

from dptrain.launcher.round_watch import RoundWatch, dynamic_handler

pytestmark = pytest.mark.timeout(60)


def _handlers(server: dist.TCPStore, run_id: str, count: int
              ) -> list[DynamicRendezvousHandler]:
    """`count` nodes, each with its own client of the store, as each agent has."""
    handlers = []
    for i in range(count):
        store = dist.TCPStore("127.0.0.1", server.port, is_master=False,
                              timeout=timedelta(seconds=20))
        handlers.append(DynamicRendezvousHandler.from_backend(
            run_id, dist.PrefixStore(f"store-{run_id}", store),
            C10dRendezvousBackend(store, run_id), min_nodes=1, max_nodes=3,
            local_addr=f"node-{i}", timeout=RendezvousTimeout(
                join=timedelta(seconds=20), last_call=timedelta(seconds=1)),
            keep_alive_interval=1, keep_alive_max_attempt=4))
    return handlers


def _in_background(call) -> threading.Thread:
    """`call()` in a thread; its error (the rendezvous closed under it) is the expected end."""
    def run() -> None:
        with contextlib.suppress(RendezvousError):
            call()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _form_a_round(handlers: list[DynamicRendezvousHandler]) -> None:
    threads = [threading.Thread(target=h.next_rendezvous, daemon=True) for h in handlers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "the round did not form"


@pytest.fixture
def store(monkeypatch):
    # As dptrain's agents run: no TCP store shared with the workers (its server would listen at
    # the node's address, here a name that resolves nowhere).
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=20))
    yield server


def test_a_node_whose_heartbeats_stop_is_seen_gone_once_torch_drops_it(store):
    a, b = _handlers(store, "silent", 2)
    _form_a_round([a, b])
    watch = RoundWatch(a)
    assert watch.silence_s == 4.0
    a.num_nodes_waiting()  # what torch's agent calls between its looks: a sync
    assert watch.gone() == []
    b._stop_heartbeats()  # b's agent is killed or cut off: it writes nothing more
    started = time.monotonic()
    while not watch.gone():
        assert time.monotonic() - started < 15, "b was never seen gone"
        time.sleep(0.2)
        a.num_nodes_waiting()
    took = time.monotonic() - started
    assert watch.gone() == ["node-1"]
    # Not before torch's window (4 x 1 s since b's last heartbeat, which a timer that fires
    # every second writes when the last is a second old: every 1-2 s), and soon after it.
    assert 2.0 <= took <= 4.0 + 1.0 + 3.0, took
    a._stop_heartbeats()


def test_a_node_waiting_to_join_is_no_loss_and_a_static_rendezvous_has_no_watch(store):
    """A third node waits to join: the round's nodes restart torch's way (not counted), and
    the first to leave the round for it must not look lost to the other."""
    a, b = _handlers(store, "joining", 2)
    _form_a_round([a, b])
    watch = RoundWatch(a)
    late, = _handlers(store, "joining", 1)
    joiner = _in_background(late.next_rendezvous)
    deadline = time.monotonic() + 15
    while a.num_nodes_waiting() == 0:
        assert time.monotonic() < deadline, "the third node never waited"
        time.sleep(0.1)
    leaving = _in_background(b.next_rendezvous)  # b restarts for it
    for _ in range(20):  # two seconds: fresh syncs (torch caches the state for one)
        a.num_nodes_waiting()
        assert watch.gone() == []
        time.sleep(0.1)
    a.set_closed()  # the others' joins end
    for thread in (joiner, leaving):
        thread.join(20)
    for h in (a, b, late):
        h._stop_heartbeats()
    assert dynamic_handler(object()) is None
    assert RoundWatch(object()).gone() == []


def test_a_newcomer_is_a_node_from_outside_the_round_not_one_that_left_to_restart(store):
    """A node of the round that restarts its workers waits to join as a newcomer does; only
    the newcomer makes a node whose workers lost their peers take it as a join (no restart
    counted): the round's own node leaving means a real loss was seen."""
    a, b = _handlers(store, "newcomer", 2)
    _form_a_round([a, b])
    watch = RoundWatch(a)
    assert watch.newcomers() == []
    leaving = _in_background(b.next_rendezvous)  # b restarts: it waits, but is no newcomer
    deadline = time.monotonic() + 15
    while a.num_nodes_waiting() == 0:
        assert time.monotonic() < deadline, "b never waited"
        time.sleep(0.1)
    assert watch.newcomers() == []
    late, = _handlers(store, "newcomer", 1)
    late_addr = "node-0"  # the helper names nodes by their index in each call
    joiner = _in_background(late.next_rendezvous)
    while not watch.newcomers():
        assert time.monotonic() < deadline, "the newcomer was never seen"
        time.sleep(0.1)
    assert watch.newcomers() == [late_addr]
    a.set_closed()
    for thread in (joiner, leaving):
        thread.join(20)
    for h in (a, b, late):
        h._stop_heartbeats()
