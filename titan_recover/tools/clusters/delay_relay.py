"""Latency without netem: a TCP relay inside a node's namespace that delays every byte.

The node's nftables redirect its new TCP connections to other nodes to this relay
(``netns.Cluster.delayed``); the relay reads each one's original destination (``SO_ORIGINAL_DST``),
dials it with a socket mark the redirect skips, and forwards both ways, each chunk ``delay_ms``
after it arrived, in order. A connection made from this node thus sees ``delay_ms`` more each way.
It serves for ``--seconds`` at most, then exits by itself.

    python -m titan_recover.tools.clusters.delay_relay --port P --delay-ms 50 --seconds 600
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
import struct
import sys
import time

log = logging.getLogger(__name__)

SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h
MARK = 0x7472  # the relay's own connections carry this mark, and the redirect lets them through
CHUNK = 1 << 16


def original_destination(sock: socket.socket) -> tuple[str, int]:
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, address = struct.unpack("!2xH4s8x", raw)
    return socket.inet_ntoa(address), port


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Forwards ``reader`` to ``writer``, each chunk ``delay_s`` after it was read; half-closes at the end."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            if not data:
                break
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()

    sender = asyncio.create_task(deliver())
    try:
        while data := await reader.read(CHUNK):
            queue.put_nowait((time.monotonic() + delay_s, data))
    except ConnectionError:
        pass
    queue.put_nowait((time.monotonic() + delay_s, b""))
    with contextlib.suppress(ConnectionError):
        await sender


async def relay(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter, delay_s: float) -> None:
    client = client_writer.get_extra_info("socket")
    destination = original_destination(client)
    upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    upstream.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, MARK)
    upstream.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(upstream, destination)
    except OSError as e:  # as the client would have seen it: the connection closes
        log.debug(f"relay to {destination} failed: {e}")
        upstream.close()
        client_writer.close()
        return
    server_reader, server_writer = await asyncio.open_connection(sock=upstream)
    try:
        await asyncio.gather(pump(client_reader, server_writer, delay_s), pump(server_reader, client_writer, delay_s))
    finally:
        for writer in (client_writer, server_writer):
            writer.close()


async def serve(port: int, delay_s: float, seconds: float) -> None:
    server = await asyncio.start_server(lambda r, w: relay(r, w, delay_s), "0.0.0.0", port)
    print("ready", flush=True)
    async with server:
        await asyncio.sleep(seconds)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay-ms", type=float, required=True)
    parser.add_argument("--seconds", type=float, default=600.0, help="it exits after this long")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.port, args.delay_ms / 1000, args.seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
