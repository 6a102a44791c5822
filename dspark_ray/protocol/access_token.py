"""A deployment's token: who may HELLO (docs/operations.md, "Security"). 256 random bits as 43 URL-safe characters,
kept in a file only its owner may read; a server compares a HELLO's in constant time and never logs one. Standard
library only, so an engine that vendors client.py may vendor this too.
"""
from __future__ import annotations

import hmac
import os
import secrets
import stat
from pathlib import Path

TOKEN_BYTES = 32
MIN_TOKEN_CHARS = 16          # below this a token is a password a guesser may find
MAKE_ONE = "dspark-ray token --new PATH"


def new_token() -> str:
    return secrets.token_urlsafe(TOKEN_BYTES)


def token_matches(expected: str, given: str) -> bool:
    """Constant time in the contents (hmac.compare_digest): how long a refusal takes tells a guesser nothing."""
    return hmac.compare_digest(expected.encode(), given.encode())


def token_refusal(expected: str | None, given: str, carrier: str) -> str | None:
    """Why `carrier` ("the HELLO", "the request") holding `given` is refused, or None (`expected` None: no token is
    needed). The reason names the rule, never either token."""
    if expected is None:
        return None
    if not given:
        return (f"token: {carrier} carries none, and this endpoint serves only holders of its deployment's token "
                f"(`dspark-ray status` says where it is kept)")
    if not token_matches(expected, given):
        return f"token: {carrier}'s is not this deployment's (docs/operations.md, \"Security\")"
    return None


def check_token(token: str, where: str) -> str:
    """`token` if it is one line of printable ASCII, at least MIN_TOKEN_CHARS long; else ValueError naming `where`
    and the rule (never the token)."""
    if not token:
        raise ValueError(f"{where}: empty (make a token with `{MAKE_ONE}`)")
    if not (token.isascii() and token.isprintable()) or any(c.isspace() for c in token):
        raise ValueError(f"{where}: a token is one word of printable ASCII (make one with `{MAKE_ONE}`)")
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"{where}: a token of {len(token)} characters is too short to resist guessing (at least "
                         f"{MIN_TOKEN_CHARS}; `{MAKE_ONE}` makes one of 43)")
    return token


def read_token_file(path: str | os.PathLike) -> str:
    """The token in the file `path` (white space around it dropped); ValueError naming the file and what is wrong."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"token file {path}: {getattr(e, 'strerror', None) or e}") from None
    return check_token(text.strip(), f"token file {path}")


def readable_by_others(path: str | os.PathLike) -> str | None:
    """Why the token file `path` is not private (its mode lets group or others read it), or None."""
    mode = os.stat(path).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        return f"token file {path} has mode {stat.S_IMODE(mode):04o}: other users may read it (chmod 600 {path})"
    return None


def write_token_file(path: str | os.PathLike, token: str) -> Path:
    """Write `token` to `path`, 0600 from its creation (its folder made 0700 if missing); replaces a file there."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, (token + "\n").encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path
