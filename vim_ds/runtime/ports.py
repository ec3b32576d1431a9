"""A free TCP port for a rendezvous (MASTER_PORT), taken from below the kernel's ephemeral range.

Why not simply bind port 0: the kernel then picks from its ephemeral range (Linux: 32768-60999), the range it also
gives every outgoing connection its source port from. Between choosing the port and the master binding it (seconds:
the launcher starts, the ranks import torch), any outgoing connection on the host may get it, and on a busy host
there are hundreds (gloo opens several between every pair of ranks; other jobs); the master then fails with
EADDRINUSE and its peers wait for it until --dist-timeout. Seen in this project's suite on 2026-11-28: a two-node
test's master lost its port that way, and the other node waited out the test's 300 s. A port below that range is
never handed out to a connection, so once free it stays free for whoever binds it on purpose.
"""
from __future__ import annotations

import random
import socket

# The lowest port chosen (SLURM jobs of launch/slurm_node.sh use 20000 + job id % 20000, small ids just above 20000).
LOWEST = 21000
EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768, Linux's default, where it cannot be read)."""
    try:
        with open(EPHEMERAL_RANGE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1", tries: int = 64) -> int:
    """A TCP port free on `host` now, below the ephemeral range where there is room (else any free one)."""
    high = ephemeral_low()
    for _ in range(tries if high - LOWEST > 1000 else 0):
        port = random.randrange(LOWEST, high)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


if __name__ == "__main__":  # launch/single_node.sh runs this file by path for its MASTER_PORT
    print(free_port())
