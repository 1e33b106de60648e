"""Addresses and ports: whether a server answers, a free local port (torch-free)."""

from __future__ import annotations

import socket
from urllib.parse import urlparse


def unreachable(url: str, timeout_s: float = 10) -> str | None:
    """Why `url`'s server cannot be reached from here within `timeout_s` (a TCP connection), or None if it can."""
    parsed = urlparse(url)
    port = parsed.port or (80 if parsed.scheme == "http" else 443)
    try:
        socket.create_connection((parsed.hostname or url, port), timeout=timeout_s).close()
    except OSError as error:
        return error.strerror or type(error).__name__
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
