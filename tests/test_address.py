"""tcp:// addresses parsed once (core/address.py), IPv6 included: what the learner derives from --listen (weights on
port + 1, rank r on port + 1 + r), what the actor derives from --learner, and what counts as loopback."""

import pytest

from impala_async.config.resolve import default_publish
from impala_async.core.address import TcpAddress, is_local, parse_tcp, port_offset


@pytest.mark.parametrize(
    "address,host,port",
    [
        ("tcp://127.0.0.1:5555", "127.0.0.1", "5555"),
        ("tcp://[::1]:5555", "::1", "5555"),
        ("tcp://[fe80::1%eth0]:7", "fe80::1%eth0", "7"),
        ("tcp://*:*", "*", "*"),
        ("TCP://host.example:1", "host.example", "1"),
    ],
)
def test_parse_and_print_back(address, host, port):
    parsed = parse_tcp(address)
    assert parsed == TcpAddress(host, port)
    assert parse_tcp(str(parsed)) == parsed  # IPv6 hosts get their brackets back


@pytest.mark.parametrize("address", ["tcp://127.0.0.1", "tcp://[::1]:port", "tcp://h:0", "tcp://h:65536", "tcp://h:-1"])
def test_a_tcp_address_without_a_valid_port_is_refused(address):
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        parse_tcp(address)


def test_other_transports_are_not_tcp():
    assert parse_tcp("ipc:///tmp/learner") is None and parse_tcp("inproc://x") is None


def test_derived_ports():
    assert port_offset("tcp://[::1]:5555", 1, "weights") == "tcp://[::1]:5556"
    assert port_offset("tcp://0.0.0.0:*", 3, "rank 2") == "tcp://0.0.0.0:*"  # each binds a port of its own
    assert default_publish("tcp://10.1.2.3:6000") == "tcp://10.1.2.3:6001"
    assert default_publish("ipc:///run/l") == "ipc:///run/l.weights"
    with pytest.raises(ValueError, match="cannot derive a publish address"):
        default_publish("tcp://h:65535")
    with pytest.raises(ValueError, match="cannot derive"):
        port_offset("udp://h:5", 1, "weights")


@pytest.mark.parametrize(
    "address,local",
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.8.9.10:1", True),
        ("tcp://[::1]:5555", True),
        ("tcp://LOCALHOST:1", True),
        ("ipc:///tmp/x", True),
        ("inproc://a", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
        ("tcp://[::]:5555", False),
        ("tcp://10.0.0.1:5", False),
        ("tcp://eth0:5", False),
        ("tcp://127.0.0.1", False),
        ("garbage", False),
    ],
)
def test_what_counts_as_this_machine(address, local):
    assert is_local(address) is local
