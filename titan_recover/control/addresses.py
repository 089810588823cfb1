"""Control-store addresses: ``host:port`` of a TCPStore or ``etcd://host:port,...``, parsed in one place."""

import re

LOOPBACK = "127.0.0.1"
ETCD_SCHEME = "etcd://"
_HOST_PORT = re.compile(r"([A-Za-z0-9.\-_]+|\[[0-9a-fA-F:]+\]):(\d{1,5})", re.ASCII)


def local_host(bind: str) -> str:
    """The host a client on this machine dials to reach a store listening on ``bind``."""
    return {"0.0.0.0": LOOPBACK, "::": "::1"}.get(bind, bind)


def parse_host_port(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) -> (host, port); ValueError naming what is wrong."""
    m = _HOST_PORT.fullmatch(text)
    if m is None:
        raise ValueError(f"{text!r} is not host:port")
    port = int(m.group(2))
    if not 0 < port < 65536:
        raise ValueError(f"{text!r}: port {port} is out of range 1..65535")
    return m.group(1).strip("[]"), port


def is_etcd(address: str) -> bool:
    """Whether a control-store address names an etcd cluster (else it is a TCPStore's host:port)."""
    return address.startswith(ETCD_SCHEME)


def parse_etcd_url(url: str) -> list[tuple[str, int]]:
    """``etcd://host:port,host:port,...`` -> its endpoints; ValueError naming what is wrong."""
    if not is_etcd(url):
        raise ValueError(f"{url!r} does not start with {ETCD_SCHEME}")
    endpoints = []
    for item in url[len(ETCD_SCHEME):].split(","):
        try:
            endpoints.append(parse_host_port(item.strip()))
        except ValueError:
            raise ValueError(f"{url!r}: {item.strip()!r} is not host:port (port 1..65535)") from None
    if len(set(endpoints)) != len(endpoints):
        raise ValueError(f"{url!r} lists an endpoint twice")
    return endpoints


def first_endpoint(address: str) -> tuple[str, int]:
    """Where to dial a control store: the TCPStore's address, or an etcd cluster's first member."""
    return parse_etcd_url(address)[0] if is_etcd(address) else parse_host_port(address)
