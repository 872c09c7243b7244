"""Reach the coordinator from refitctl: a malformed address is a usage error, an unreachable
one fails within a second or two (not after the whole call timeout) naming the address it
tried and how to set another."""

from __future__ import annotations

import argparse
import queue
from pathlib import Path
from typing import Any

import grpc

from refitplane.errors import InvalidArgument, Unavailable
from refitplane.protocol.channel import sync_channel

HOW_TO_SET = "set it with --coordinator HOST:PORT or REFIT_COORDINATOR"
# gRPC's own target forms (unix sockets, resolvers) pass through unchecked.
_GRPC_SCHEMES = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:")
# The longest wait for a connection (a host that drops packets; a refused one fails at once).
CONNECT_WAIT_S = 5.0


def check_address(target: str) -> str:
    """`host:port` (IPv6 in brackets) or a gRPC target URI; else InvalidArgument."""
    if target.startswith(_GRPC_SCHEMES):
        return target
    problem = ""
    if "://" in target:
        problem = "give HOST:PORT without a scheme"
    else:
        host, sep, port = target.rpartition(":")
        if not sep or not host:
            problem = "give HOST:PORT"
        elif not port.isdigit() or not 0 < int(port) < 65536:
            problem = f"port {port!r} is not 1..65535"
        elif ":" in host and not (host.startswith("[") and host.endswith("]")):
            problem = "write an IPv6 address in brackets, [::1]:50051"
    if problem:
        raise InvalidArgument(
            f"malformed coordinator address {target!r}: {problem}; {HOW_TO_SET}",
            field="coordinator",
        )
    return target


def wait_reachable(target: str, *, tls_ca: str | Path | None, timeout_s: float) -> None:
    """Connect once: return when the channel is READY; raise Unavailable as soon as the
    connection fails (refused, unresolvable, TLS handshake) or after `timeout_s`."""
    channel = sync_channel(target, tls_ca=tls_ca)
    states: queue.Queue[grpc.ChannelConnectivity] = queue.Queue()
    channel.subscribe(states.put, try_to_connect=True)
    try:
        while True:
            try:
                state = states.get(timeout=timeout_s)
            except queue.Empty:
                cause = f"no connection within {timeout_s:g} s"
                break
            if state is grpc.ChannelConnectivity.READY:
                return
            if state in (
                grpc.ChannelConnectivity.TRANSIENT_FAILURE,
                grpc.ChannelConnectivity.SHUTDOWN,
            ):
                cause = "connection failed" + (" (TLS)" if tls_ca else "")
                break
    finally:
        channel.unsubscribe(states.put)
        channel.close()
    raise Unavailable(f"cannot reach the coordinator at {target}: {cause}; {HOW_TO_SET}")


def open_client(args: argparse.Namespace) -> Any:
    """The RefitClient refitctl's flags and REFIT_* variables describe, once reachable."""
    from refitplane.client import ClientSettings, RefitClient

    s = ClientSettings()
    target = check_address(args.coordinator or s.coordinator)
    tls_ca = args.tls_ca or s.tls_ca_file
    wait_reachable(target, tls_ca=tls_ca, timeout_s=min(args.timeout, CONNECT_WAIT_S))
    return RefitClient(target, token=args.token or s.token(), tls_ca=tls_ca, timeout_s=args.timeout)
