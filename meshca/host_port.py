"""`HOST:PORT` addresses split and joined in one place: the listening flags of both daemons
(`meshca.listen`), the status servers, and the CA address an agent dials (`agent.ca_client`).

The form is `HOST:PORT`, an IPv6 host in brackets (`[::1]:15012`), a port of ASCII digits
0-65535; the host may be empty (a listener reads that as 127.0.0.1). Anything else is a
`ValueError` whose message says what is wrong and shows the right form, for the caller to
prefix with the flag that carried it. `join_host_port` writes an address back in the same form,
so a split address always splits again.

Dependency-free on purpose: the configuration modules of every command import it.
"""

from __future__ import annotations

MAX_PORT = 65535


def split_host_port(address: str) -> tuple[str, int]:
    """(host, port) of `HOST:PORT` or `[v6]:PORT`, brackets removed; `ValueError` otherwise."""
    host, colon, port = address.rpartition(":")
    if not colon or not (port.isascii() and port.isdigit()) or int(port) > MAX_PORT:
        raise ValueError(f"expected HOST:PORT with a port 0-{MAX_PORT}, e.g. 127.0.0.1:15014")
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    if "[" in host or "]" in host or (":" in host and not bracketed):
        raise ValueError("expected an IPv6 host in one pair of brackets, e.g. [::1]:15014")
    return host, int(port)


def join_host_port(host: str, port: int) -> str:
    """`host:port`, an IPv6 host in brackets: what `split_host_port` splits back."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
