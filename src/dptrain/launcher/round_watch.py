"""Which nodes of this agent's round of torch's dynamic rendezvous (c10d or etcd) are gone
from it: how an agent learns of a lost node from the agents' heartbeats, not from its workers.

A node killed outright closes its sockets, and the survivors' next collective fails at once. A
node cut off the network (a switch, a cable, a hung kernel) closes nothing: the survivors'
collective waits for the process group's timeout (--timeout, minutes), which has to stay long,
since a rank that is merely slow (a long checkpoint write, a straggler) must not be taken for a
lost one. Every agent of a dynamic rendezvous writes a heartbeat into the rendezvous state
(every keep_alive_interval s), and torch drops a node from the round once it has been silent
for keep_alive_interval x keep_alive_max_attempt s, but torch's agent never looks: it restarts
only when its own workers fail or a node waits to join. `RoundWatch` looks. Heartbeats come
from the agents, which do nothing else, so a slow or stalled worker never stops them: only a
node whose agent is gone or cut off is dropped.

It reads the state torch's agent keeps in sync between its looks at the workers (torch's
`num_nodes_waiting`, at most a second old), under the handler's own lock; it makes no request.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

LOCK_WAIT_S = 0.2
"""How long a look waits for the handler's lock (held while a heartbeat or a sync is under
way); a look that does not get it sees nothing, and the next one, 0.1 s later, tries again."""


def dynamic_handler(handler: Any) -> DynamicRendezvousHandler | None:
    """torch's dynamic handler behind `handler` (dptrain's etcd handler wraps one), else None
    (a static rendezvous keeps no heartbeats)."""
    inner = getattr(handler, "_inner", handler)
    return inner if isinstance(inner, DynamicRendezvousHandler) else None


class _Seen(NamedTuple):
    """What a look found (the parts of torch's _RendezvousState it reads)."""

    round: int
    closed: bool
    participants: dict
    wait_list: frozenset


class RoundWatch:
    """The nodes of the round this agent has just joined, and which of them are gone since."""

    def __init__(self, handler: Any) -> None:
        self._handler = dynamic_handler(handler)
        seen = self._look(wait_s=5.0)  # a heartbeat may hold the lock for a moment
        self._round = seen.round if seen else None
        self._members = dict(seen.participants) if seen else {}

    @property
    def silence_s(self) -> float:
        """How long a node may be silent before the rendezvous drops it."""
        settings = self._handler.settings if self._handler else None
        if settings is None:
            return 0.0
        return settings.keep_alive_interval.total_seconds() * settings.keep_alive_max_attempt

    def _look(self, wait_s: float = LOCK_WAIT_S) -> _Seen | None:
        """A copy of the handler's rendezvous state, or None (no dynamic handler, its state
        holder moved in torch, or the lock is busy)."""
        handler = self._handler
        holder = getattr(handler, "_state_holder", None)
        lock = getattr(handler, "_heartbeat_lock", None)
        if holder is None or lock is None or not lock.acquire(timeout=wait_s):
            return None
        try:
            state = holder.state
            return _Seen(state.round, state.closed, dict(state.participants),
                         frozenset(state.wait_list))
        finally:
            lock.release()

    def gone(self) -> list[str]:
        """The addresses of the round's nodes that are no longer in it while nobody waits to
        join (a node that joins makes every node restart, torch's own way, and that costs no
        restart) and the rendezvous is open: dropped for silence, or leaving to restart."""
        seen = self._look()
        if seen is None or seen.closed or seen.wait_list or seen.round != self._round:
            return []
        return sorted(node.addr for node in self._members if node not in seen.participants)

    def newcomers(self) -> list[str]:
        """The addresses of the nodes waiting to join that were not in this round: a node
        coming (back) in, as opposed to a node of the round that left to restart its workers.
        Synced first (one request), so that a node that has just asked is seen."""
        handler = self._handler
        if handler is None:
            return []
        handler.num_nodes_waiting()  # torch's sync of the rendezvous state
        seen = self._look()
        if seen is None or seen.round != self._round:
            return []
        return sorted(node.addr for node in seen.wait_list if node not in self._members)
