"""Listeners that hold a port without being a c10d rendezvous store, for the tests of a port
taken by something else."""

from __future__ import annotations

import socket
import threading


def accepts_nothing(listener: socket.socket) -> None:
    """Connections wait in the backlog: torch's client alone would wait for an answer forever."""


def answers_http(listener: socket.socket) -> None:
    """Answers every connection as a web server refusing it."""
    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed at the end of the test
                return
            with conn:
                conn.recv(1024)
                conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")

    threading.Thread(target=serve, daemon=True).start()
