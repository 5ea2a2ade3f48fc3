"""The one way this project starts a listening `TCPStore`: on the configured address only.

torch 2.13's `TCPStore(host, port, ..., is_master=True)` listens on every interface (`*:PORT`,
IPv4 and IPv6) whatever `host` says — `host` is only where clients connect
(tests/launch/test_listen.py measures it). So the socket is bound here, to `host` exactly,
and handed to the store through `master_listen_fd`; the store owns (and closes) it from then
on. Every store or server the project hosts — the controller's actor world and sync group
(`resharding.sync_group.host_store`), the reward-model group, `launch.spawn.run_on_ranks`
(tests, bench, conversion ranks), `launch.slurm.run_this_rank` (srun ranks) — starts here.

The address: what the caller configured, else `listen_address()` — MCORE_RL_NODE_IP (set per
node by the SLURM launcher) or loopback.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket

import torch.distributed as dist

LOOPBACK = "127.0.0.1"


def listen_address() -> str:
    """Where this process's servers listen: MCORE_RL_NODE_IP if set, else loopback — never
    all interfaces."""
    return os.environ.get("MCORE_RL_NODE_IP") or LOOPBACK


def bound_socket(host: str, port: int = 0, backlog: int = 128) -> socket.socket:
    """A TCP socket listening on `host:port` only (`port` 0: the OS picks). `host` must be a
    concrete address or a name resolving to one; a wildcard ("", 0.0.0.0, ::) is refused."""
    if host in ("", "0.0.0.0", "::"):
        raise ValueError(f"listen address {host!r}: a wildcard listens on every interface; "
                         "give the node's address (MCORE_RL_NODE_IP) or 127.0.0.1")
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # a fixed port (srun rendezvous) may still be in TIME_WAIT from a previous job
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(backlog)
    except OSError as err:
        sock.close()
        raise OSError(err.errno, f"cannot listen on {host}:{port}: {err.strerror}") from None
    return sock


def listening_store(host: str | None = None, port: int = 0, world_size: int = 1, *,
                    timeout_s: float = 120.0, wait_for_workers: bool = False) -> dist.TCPStore:
    """A master `TCPStore` listening on `host:port` only (default host: `listen_address()`;
    port 0: the OS picks, read it from `.port`). Clients connect as usual."""
    host = host or listen_address()
    sock = bound_socket(host, port)
    bound_port = sock.getsockname()[1]
    fd = sock.detach()  # the store owns the descriptor now (closed when the store goes)
    try:
        return dist.TCPStore(host, bound_port, world_size, is_master=True,
                             wait_for_workers=wait_for_workers, master_listen_fd=fd,
                             timeout=datetime.timedelta(seconds=timeout_s))
    except BaseException:
        os.close(fd)
        raise


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1, and IPv4-mapped loopback (::ffff:127.0.0.1: Ray's gRPC servers
    listen on an IPv6 socket bound to that)."""
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback
