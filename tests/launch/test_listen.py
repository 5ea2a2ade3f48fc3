"""`launch.listen`: a hosted TCPStore listens on its configured address only (torch's own
`TCPStore(host, ..., is_master=True)` listens on every interface), and clients still work."""

import datetime
import os

import psutil
import pytest
import torch.distributed as dist

from mcore_rl.launch.listen import bound_socket, is_loopback, listen_address, listening_store
from mcore_rl.resharding import host_store

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast


def _listening(pid: int) -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("inet")
            if c.status == psutil.CONN_LISTEN}


def test_store_listens_on_its_address_only_and_serves_clients():
    store = listening_store("127.0.0.1", world_size=2, timeout_s=10)
    client = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False,
                           timeout=datetime.timedelta(seconds=10))
    client.set("k", b"v")
    assert store.get("k") == b"v"
    on_port = {addr for addr in _listening(os.getpid()) if addr[1] == store.port}
    assert on_port == {("127.0.0.1", store.port)}


def test_torch_alone_listens_everywhere_which_is_why_this_exists():
    """The measured fact behind launch.listen; if torch ever
    honours `host`, this fails and the workaround can go."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    on_port = {ip for ip, port in _listening(os.getpid()) if port == store.port}
    assert on_port - {"127.0.0.1", "::1"}, on_port


def test_sync_group_store_and_ipv6_loopback():
    store = host_store("127.0.0.1", world_size=1)
    assert {ip for ip, p in _listening(os.getpid()) if p == store.port} == {"127.0.0.1"}
    try:
        v6 = listening_store("::1", timeout_s=10)
    except OSError:
        pytest.skip("no IPv6 loopback on this machine (the IPv4 case above ran)")
    assert {ip for ip, p in _listening(os.getpid()) if p == v6.port} == {"::1"}


def test_wildcards_are_refused_and_the_default_is_loopback(monkeypatch):
    for wildcard in ("", "0.0.0.0", "::"):
        with pytest.raises(ValueError, match="wildcard"):
            bound_socket(wildcard)
    monkeypatch.delenv("MCORE_RL_NODE_IP", raising=False)
    assert listen_address() == "127.0.0.1"
    monkeypatch.setenv("MCORE_RL_NODE_IP", "10.1.2.3")
    assert listen_address() == "10.1.2.3"
    assert is_loopback("::1") and is_loopback("127.0.0.1") and is_loopback("::ffff:127.0.0.1")
    assert not is_loopback("10.1.2.3") and not is_loopback("::ffff:10.1.2.3")
