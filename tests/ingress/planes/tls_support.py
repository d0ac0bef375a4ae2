"""In-memory TLS 1.3 pairs (two SSLObjects over memory BIOs) and a record codec for key checks."""

from __future__ import annotations

import ssl
import struct
from dataclasses import dataclass

from cryptography.hazmat.primitives.ciphers.aead import AESGCM


@dataclass
class MemPair:
    srv: ssl.SSLObject
    cli: ssl.SSLObject
    s_in: ssl.MemoryBIO
    s_out: ssl.MemoryBIO
    c_in: ssl.MemoryBIO
    c_out: ssl.MemoryBIO

    def to_server(self) -> bytes:
        data = self.c_out.read()
        self.s_in.write(data)
        return data

    def to_client(self) -> bytes:
        data = self.s_out.read()
        self.c_in.write(data)
        return data


def handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext) -> MemPair:
    s_in, s_out, c_in, c_out = (ssl.MemoryBIO() for _ in range(4))
    srv = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    cli = client_ctx.wrap_bio(c_in, c_out, server_hostname="localhost")
    p = MemPair(srv, cli, s_in, s_out, c_in, c_out)
    done = [False, False]
    for _ in range(10):
        for i, obj in enumerate((cli, srv)):
            if not done[i]:
                try:
                    obj.do_handshake()
                    done[i] = True
                except ssl.SSLWantReadError:
                    pass
            p.to_server()
            p.to_client()
        if all(done):
            return p
    raise AssertionError("handshake did not complete")


@dataclass
class CryptoInfo:
    """struct tls12_crypto_info_aes_gcm_{128,256} as the kernel receives it."""

    version: int
    cipher_type: int
    iv: bytes
    key: bytes
    salt: bytes
    rec_seq: int

    @classmethod
    def parse(cls, raw: bytes) -> CryptoInfo:
        version, cipher = struct.unpack_from("<HH", raw)
        klen = {51: 16, 52: 32}[cipher]
        iv = raw[4:12]
        key = raw[12 : 12 + klen]
        salt = raw[12 + klen : 16 + klen]
        seq = int.from_bytes(raw[16 + klen : 24 + klen], "big")
        assert len(raw) == 24 + klen
        return cls(version, cipher, iv, key, salt, seq)

    def nonce(self, seq: int) -> bytes:
        base = int.from_bytes(self.salt + self.iv, "big")
        return (base ^ seq).to_bytes(12, "big")

    def seal(self, seq: int, plaintext: bytes, content_type: int = 23, *, padding: int = 0) -> bytes:
        inner = plaintext + bytes([content_type]) + bytes(padding)  # RFC 8446 5.4: zeros after the type
        header = b"\x17\x03\x03" + struct.pack(">H", len(inner) + 16)
        return header + AESGCM(self.key).encrypt(self.nonce(seq), inner, header)

    def open(self, seq: int, record: bytes) -> tuple[int, bytes]:
        header, body = record[:5], record[5:]
        inner = AESGCM(self.key).decrypt(self.nonce(seq), body, header).rstrip(b"\x00")
        return inner[-1], inner[:-1]
