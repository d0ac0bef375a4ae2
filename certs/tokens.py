"""Bearer tokens kept in files (the scheduler's admin token): made, read and hashed one way everywhere.

A token file holds the token on one line. Whatever reads one (the scheduler's ``admin_token_file``,
``sbxnet certs token --hash``, ``sbxnet scheduler status --token-file``) takes the text with surrounding
whitespace removed, so the trailing newline an editor or ``echo`` adds is never part of the token, and
hashes it as ``token_sha256`` does: SHA-256 of the token's bytes, lower-case hex. That hash is what
``admin_token_sha256`` is set to (``sha256sum`` of the file would hash the newline too).
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path


class TokenFileError(ValueError):
    """The file cannot be read, or holds no token, or more than one line (the message names the file)."""


def token_sha256(token: str) -> str:
    """The token's SHA-256 as the scheduler compares it: lower-case hex of its UTF-8 bytes."""
    return hashlib.sha256(token.encode()).hexdigest()


def check_token(token: str, where: str) -> str:
    """``token`` if it is one line of visible ASCII (what an ``Authorization: Bearer`` header carries)."""
    if not token:
        raise TokenFileError(f"{where} is empty: it must hold the token, on one line")
    if any(not (0x21 <= ord(ch) <= 0x7E) for ch in token):
        raise TokenFileError(f"{where} must hold the token alone, on one line (visible ASCII, no spaces)")
    return token


def read_token_file(path: Path) -> str:
    """The token in ``path``: its text with surrounding whitespace (the trailing newline) removed."""
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise TokenFileError(f"{path} is not text: it must hold the token, on one line") from None
    except OSError as e:
        raise TokenFileError(f"cannot read {path}: {e.strerror or e}") from None
    return check_token(text.strip(), str(path))


def new_token() -> str:
    """A fresh token: 32 random bytes, URL-safe base64 (43 characters)."""
    return secrets.token_urlsafe(32)


def write_token_file(path: Path, token: str, *, replace: bool = False) -> None:
    """Write ``token`` and a newline to ``path``, mode 0600; an existing file is kept unless ``replace``
    (raises FileExistsError)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if replace else os.O_EXCL)
    fd = os.open(path, flags, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
