"""Gloo's interface is picked by the address a rank reaches the leader from, not by a name."""

import socket

from moeserve.cluster.netif import data_interface, interface_of, local_address_towards


def test_the_route_to_the_loopback_leader_is_the_loopback_interface():
    assert local_address_towards("127.0.0.1") == "127.0.0.1"
    lo = interface_of("127.0.0.1")
    assert lo is not None and lo in {name for _, name in socket.if_nameindex()}
    assert data_interface("localhost") == lo


def test_an_address_no_interface_holds_has_no_interface():
    assert interface_of("203.0.113.77") is None  # TEST-NET-3: never configured here
