"""The one HTTP probe: is something answering at a URL, within a few seconds?

Used for the tracking server's /health, the hub before a download, a server's /health while it starts
and during a sweep, and a server's model list. httpx, with a timeout on every call: a server that accepts
the connection and never answers must not hang qeval.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any
from urllib.parse import urlsplit, urlunsplit


def redact(uri: str) -> str:
    """The URI as messages and records show it: no user name or password, no query or fragment (where a token
    may be passed)."""
    parts = urlsplit(uri)
    if not (parts.username or parts.password or parts.query or parts.fragment):
        return uri  # as given: a rebuilt sqlite:////path would lose a slash
    if parts.username or parts.password:
        host = parts.hostname or ""
        parts = parts._replace(netloc=f"***@{host}" + (f":{parts.port}" if parts.port else ""))
    return urlunsplit(parts._replace(query="***" if parts.query else "", fragment=""))


def scrub(text: str) -> str:
    """`text` with any credentials in URLs (`scheme://user:password@host`) replaced by ***."""
    return re.sub(r"(\w+://)[^/\s@]+@", r"\1***@", text)


class Unreachable(Exception):
    """Nothing answered in time, or the answer was an error: `why` says which, in a few words."""

    def __init__(self, url: str, why: str):
        super().__init__(f"{redact(url)}: {why}")
        self.url, self.why = redact(url), why


@cache
def _tls() -> Any:
    """The TLS context every probe shares, made once. httpx makes one for each client (its CA bundle read and
    parsed), and a probe is a client: a server polled twice a second while it starts would pay more for
    certificates than for the polls, out of the CPU the server needs to start."""
    import httpx

    return httpx.create_ssl_context()  # what httpx.get makes by default: certifi's bundle, or SSL_CERT_FILE


def probe(url: str, timeout: float, *, auth: tuple[str, str] | None = None, ok_only: bool = True) -> Any:
    """GET `url` within `timeout` seconds and return the response; Unreachable where nothing answered (and,
    with `ok_only`, where the answer was an HTTP error)."""
    import httpx

    try:
        r = httpx.get(url, timeout=timeout, auth=auth, follow_redirects=True, verify=_tls())
        if ok_only:
            r.raise_for_status()
        return r
    except httpx.HTTPError as e:
        raise Unreachable(url, "no answer" if isinstance(e, httpx.TimeoutException) else type(e).__name__) from None


def answers(url: str, timeout: float = 5.0) -> bool:
    """Whether the server at base `url` answers /health with 200 now."""
    try:
        return probe(f"{url.rstrip('/')}/health", timeout).status_code == 200
    except Unreachable:
        return False


def json_or(url: str, default: Any, timeout: float = 10.0) -> Any:
    """The JSON document at `url`, or `default` where nothing (or no JSON) answers."""
    try:
        return probe(url, timeout).json()
    except (Unreachable, ValueError):
        return default
