"""Control-store addresses: ``host:port`` of a TCPStore, ``etcd://host:port,...`` or ``nodes://host,...`` (an etcd
the run's own launchers form, ``launch.members``), parsed and resolved in one place.

Hosts are IPv4 addresses or names: a bracketed IPv6 literal is refused when parsed. Supporting it would
reach past the store (the launcher writes the coordinator's address as ``host:port``, a group's parts
meet at an IPv4 rendezvous address), and a refusal in seconds beats an address that is taken and then
never answers.
"""

import ipaddress
import re
import socket

LOOPBACK = "127.0.0.1"
ETCD_SCHEME = "etcd://"
NODES_SCHEME = "nodes://"
ETCD_CLIENT_PORT = 2379  # etcd's own default; its peers talk on the port after it (2380)
NODES_MEMBERS = (3, 5)  # a majority survives 1 (2) losses; more members slow every write and survive no more here
_HOST = re.compile(r"[A-Za-z0-9.\-_]+", re.ASCII)
_HOST_PORT = re.compile(r"(.*):(\d{1,5})", re.ASCII | re.DOTALL)
NO_IPV6 = "IPv6 is not supported: use an IPv4 address or a host name that resolves to one"


def local_host(bind: str) -> str:
    """The host a client on this machine dials to reach a store listening on ``bind``."""
    return LOOPBACK if bind == "0.0.0.0" else bind


def node_host(bind: str) -> str:
    """The host this node's ranks dial to reach a coordinator listening on ``bind`` in a run that spans
    nodes: each rank's replicate groups listen on its route to it (``route_address``), so it must be an
    address the other nodes reach, not loopback. On every interface (0.0.0.0): the address this host's
    name resolves to; ValueError naming the host where that is loopback (Debian's 127.0.1.1)."""
    if bind != "0.0.0.0":
        return bind
    name = socket.gethostname()
    ip = resolve(name)
    if ipaddress.ip_address(ip).is_loopback:
        raise ValueError(f"this host's name {name!r} resolves to {ip}, a loopback address the other nodes cannot reach")
    return ip


def _is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).version == 6
    except ValueError:
        return False


def parse_host(text: str) -> str:
    """A host name or IPv4 address; ValueError naming what is wrong."""
    if _is_ipv6(text):
        raise ValueError(f"{text!r}: {NO_IPV6}")
    if not _HOST.fullmatch(text):
        raise ValueError(f"{text!r} is not a host name or IPv4 address")
    return text


def parse_host_port(text: str) -> tuple[str, int]:
    """``host:port`` -> (host, port); ValueError naming what is wrong."""
    m = _HOST_PORT.fullmatch(text)
    if m is not None and _is_ipv6(m.group(1)):
        raise ValueError(f"{text!r}: {NO_IPV6}")
    if m is None or not _HOST.fullmatch(m.group(1)):
        raise ValueError(f"{text!r} is not host:port")
    port = int(m.group(2))
    if not 0 < port < 65536:
        raise ValueError(f"{text!r}: port {port} is out of range 1..65535")
    return m.group(1), port


def resolve(host: str) -> str:
    """``host``'s IPv4 address; ValueError naming the host when it has none."""
    try:
        return str(socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(
            f"host {host!r} does not resolve to an IPv4 address ({getattr(e, 'strerror', None) or e})"
        ) from None


def check_bindable(host: str) -> str:
    """``host``'s IPv4 address, if a socket on this machine can listen there; ValueError naming it if not."""
    ip = resolve(host)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, 0))
        except OSError as e:
            raise ValueError(f"{ip} is not an address of this host ({e.strerror})") from None
    return ip


def check_port_free(ip: str, port: int) -> None:
    """OSError if nothing on this host can listen on ``ip:port`` now (another process holds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server binds: a port in TIME_WAIT is free
        s.bind((ip, port))


def is_etcd(address: str) -> bool:
    """Whether a control-store address names an etcd cluster (else it is a TCPStore's host:port)."""
    return address.startswith(ETCD_SCHEME)


def parse_etcd_url(url: str) -> list[tuple[str, int]]:
    """``etcd://host:port,host:port,...`` -> its endpoints; ValueError naming what is wrong."""
    if not is_etcd(url):
        raise ValueError(f"{url!r} does not start with {ETCD_SCHEME}")
    endpoints = []
    for item in url[len(ETCD_SCHEME) :].split(","):
        try:
            endpoints.append(parse_host_port(item.strip()))
        except ValueError as e:
            why = NO_IPV6 if NO_IPV6 in str(e) else "port 1..65535"
            raise ValueError(f"{url!r}: {item.strip()!r} is not host:port ({why})") from None
    if len(set(endpoints)) != len(endpoints):
        raise ValueError(f"{url!r} lists an endpoint twice")
    return endpoints


def parse_nodes_url(url: str) -> list[tuple[str, int]]:
    """``nodes://host[:port],...`` -> the hosts whose launchers run an etcd member and each one's client port
    (default ``ETCD_CLIENT_PORT``, its peer port the next); ValueError naming what is wrong."""
    if not url.startswith(NODES_SCHEME):
        raise ValueError(f"{url!r} does not start with {NODES_SCHEME}")
    members = []
    for item in (item.strip() for item in url[len(NODES_SCHEME) :].split(",")):
        try:
            host, port = parse_host_port(item) if _HOST_PORT.fullmatch(item) else (parse_host(item), ETCD_CLIENT_PORT)
        except ValueError as e:
            raise ValueError(f"{url!r}: {e}") from None
        if port > 65534:
            raise ValueError(f"{url!r}: {item!r}: port {port} leaves no peer port after it (at most 65534)")
        if host == "localhost" or (_is_ip(host) and ipaddress.ip_address(host).is_loopback):
            raise ValueError(f"{url!r}: {host!r} is loopback: name each node by an address the other nodes reach")
        members.append((host, port))
    if len({host for host, _ in members}) != len(members):
        raise ValueError(f"{url!r} lists a host twice: one etcd member per node")
    if len(members) not in NODES_MEMBERS:
        raise ValueError(
            f"{url!r} names {len(members)} node(s): etcd members on 3 or 5 nodes (a majority of them must live; 3 "
            "survive the loss of one, 5 of two)"
        )
    return members


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def first_endpoint(address: str) -> tuple[str, int]:
    """Where to dial a control store: the TCPStore's address, or an etcd cluster's first member."""
    return parse_etcd_url(address)[0] if is_etcd(address) else parse_host_port(address)


def route_address(address: str) -> str:
    """This host's address on its route to a control store (the local end of a UDP socket aimed at
    it; nothing is sent): the interface the other nodes reach, whatever the host name resolves to."""
    host, port = first_endpoint(address)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((resolve(host), port))
        return s.getsockname()[0]
