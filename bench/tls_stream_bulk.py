"""TlsStream's own cost per byte: 512 MiB through a TlsStream pair over a socketpair, both ends on one
uvloop thread; CPU (thread time) per GB moved, encryption and decryption included.

    .venv/bin/python bench/tls_stream_bulk.py <label> [--mib 512] [--read 65536]

Run it interleaved against another version of sbxnet/tls_stream.py (old new new old); the figures are in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import ssl
import sys
import tempfile
import time
from pathlib import Path

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from certs.mint import mint_ca, mint_leaf, write_issued
from sbxnet.tls_stream import TlsStream


def contexts() -> tuple[ssl.SSLContext, ssl.SSLContext]:
    d = Path(tempfile.mkdtemp(prefix="tls-bulk-"))
    ca = mint_ca()
    write_issued(ca, d, "ca")
    write_issued(mint_leaf(ca, "server", dns=("localhost",)), d, "server")
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(d / "server.crt", d / "server.key")
    return server, ssl.create_default_context(cafile=str(d / "ca.crt"))


async def run(total: int, read_size: int) -> tuple[int, float]:
    server_ctx, client_ctx = contexts()
    a, b = socket.socketpair()
    srv, cli = await asyncio.gather(
        TlsStream.accept(a, server_ctx, timeout=5),
        TlsStream.connect(b, client_ctx, server_hostname="localhost", timeout=5),
    )
    payload = os.urandom(1 << 20)

    async def writer() -> None:
        sent = 0
        while sent < total:
            await srv.write(payload)
            sent += len(payload)
        await srv.write_eof()

    task = asyncio.create_task(writer())
    got = 0
    cpu0 = time.thread_time()
    while chunk := await cli.read(read_size):
        got += len(chunk)
    cpu = time.thread_time() - cpu0
    await task
    srv.close()
    cli.close()
    return got, cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("label")
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--read", type=int, default=65536, help="bytes asked of each read (the gateway asks 65536)")
    args = ap.parse_args()
    got, cpu = uvloop.run(run(args.mib << 20, args.read))
    print(f"{args.label}: {got >> 20} MiB, {cpu / (got / 1e9):.2f} CPU-s/GB (both ends, one thread)")


if __name__ == "__main__":
    main()
