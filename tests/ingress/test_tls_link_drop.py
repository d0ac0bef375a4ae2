"""TlsLink.drop_tls: once kernel TLS carries a session, the forwarder frees OpenSSL's objects at once
(not when the tunnel ends) and sends nothing in doing so."""

from __future__ import annotations

import asyncio
import gc
import socket
import ssl
import threading
import weakref

from fwd_support import GwClient, Pki

from certs import loader
from forwarder.ingress.tls_link import TlsLink


def test_drop_tls_frees_the_session_and_sends_nothing(pki: Pki) -> None:
    cert, key = pki.paths["forwarder"]
    ctx = loader.server_context(cert_file=cert, key_file=key, ca_file=pki.ca_file)  # the link's profile
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    clients: list[GwClient] = []
    client_done = threading.Event()

    def client() -> None:
        c = GwClient(port, pki.client_ctx(), timeout=10)
        c.handshake()
        clients.append(c)
        client_done.set()

    async def serve() -> weakref.ref[ssl.SSLObject]:
        loop = asyncio.get_running_loop()
        listener.setblocking(False)
        t = threading.Thread(target=client)
        t.start()
        sock, _ = await loop.sock_accept(listener)
        sock.setblocking(False)
        link = TlsLink(sock, ctx)
        await link.handshake()
        await asyncio.to_thread(client_done.wait, 10)
        ref = weakref.ref(link.ssl)
        link.drop_tls()
        assert not hasattr(link, "incoming") and not hasattr(link, "outgoing")  # the BIOs went with it
        gc.collect()
        t.join(10)
        clients[0].sock.settimeout(0.3)
        try:
            got = clients[0].sock.recv(100)
        except TimeoutError:
            got = None
        assert got is None  # no alert, no close_notify: the peer heard nothing
        assert link.sock.fileno() >= 0  # the socket itself stays, for the kernel's TLS
        link.sock.close()
        return ref

    assert asyncio.run(serve())() is None  # the SSL object is gone, not waiting for the tunnel's end
    clients[0].close()
    listener.close()
