"""proto/transport.free_port: a port free now, from below the kernel's ephemeral range where Linux leaves room."""

import socket

from shardserve.proto.transport import _QUIET_PORTS_FROM, _ephemeral_low, free_port


def test_free_ports_come_from_below_the_ephemeral_range_and_can_be_bound():
    low = _ephemeral_low()
    for _ in range(20):
        port = free_port()
        if low > _QUIET_PORTS_FROM + 1000:
            assert _QUIET_PORTS_FROM <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
