"""Remote URLs: parsing, and redaction so credentials are never shown.

    redis://[user[:password]@]host[:port][/db]         one server
    rediss://...                                        the same over TLS
    redis+cluster://[user[:password]@]h1:p1,h2:p2,...   Redis Cluster (startup nodes)
    rediss+cluster://...                                Redis Cluster over TLS

A cluster is chosen by the scheme, the one place that says what kind of
server it is; query parameters are refused rather than half-understood.
User and password are percent-decoded (write `%40` for an `@` in them).
Every message this module builds shows the URL through `redact` (engine/config.py),
which hides the user and password together (a user name can be as telling as a
secret), and any query or fragment.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import quote, unquote

from ...config import RemoteConfigError, Url, redact, reveal

DEFAULT_PORT = 6379
SCHEMES = {"redis": (False, False), "rediss": (True, False),
           "redis+cluster": (False, True), "rediss+cluster": (True, True)}  # scheme -> (tls, cluster)
_HOST_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")
_IPV6_RE = re.compile(r"\[([0-9A-Fa-f:.]{2,45})\]")



@dataclass(frozen=True)
class RemoteConfig:
    tls: bool
    cluster: bool
    nodes: tuple[tuple[str, int], ...]  # one for a single server; startup nodes for a cluster
    db: int = 0
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)
    redacted: str = ""  # the URL as it may be shown

    def secrets(self) -> tuple[str, ...]:
        """The strings that must never be shown, raw and percent-encoded."""
        out = []
        for s in (self.password, self.username):
            if s:
                out += [s, quote(s, safe=""), quote(s)]
        return tuple(sorted(set(out), key=len, reverse=True))  # longest first: no partial replacement


def scrub(text: str, secrets: tuple[str, ...]) -> str:
    """Text (an exception message, say) with every secret replaced by `***`."""
    for s in secrets:
        text = text.replace(s, "***")
    return text


def parse_remote_url(url: str) -> RemoteConfig:
    """The URL's config, or RemoteConfigError (the URL redacted). The error is raised here, outside
    the parser, so no frame of a traceback (%xmode Verbose shows their variables) holds the raw URL."""
    try:
        return _parse(str.__str__(url) if isinstance(url, Url) else reveal(url))
    except RemoteConfigError as e:
        error = str(e)
    raise RemoteConfigError(error) from None


def _parse(url: str) -> RemoteConfig:
    if not isinstance(url, str) or not url.strip():
        raise RemoteConfigError("remote URL is empty: expected redis://host:port (see cache/remote/config.py)")
    shown = redact(url)

    def bad(why: str) -> RemoteConfigError:
        return RemoteConfigError(f"invalid remote URL {shown!r}: {why}")

    scheme, sep, rest = url.partition("://")
    if not sep:
        raise bad("no scheme; use redis://, rediss://, redis+cluster:// or rediss+cluster://")
    if scheme.lower() not in SCHEMES:
        raise bad(f"unsupported scheme {scheme!r}; use redis://, rediss://, redis+cluster:// or rediss+cluster://")
    tls, cluster = SCHEMES[scheme.lower()]
    username = password = None
    if "@" in rest:
        userinfo, rest = rest.rsplit("@", 1)
        user, colon, pw = userinfo.partition(":")
        username, password = unquote(user) or None, (unquote(pw) if colon else None) or None
    if "#" in rest:
        raise bad("a fragment (#...) has no meaning here")
    rest, qmark, query = rest.partition("?")
    if qmark:
        hint = " (a cluster is chosen by the scheme: redis+cluster://)" if "cluster" in query.lower() else ""
        raise bad(f"query parameters are not supported{hint}")
    hosts, slash, path = rest.partition("/")
    nodes = tuple(_parse_node(h, bad) for h in hosts.split(","))
    if len(nodes) > 1 and not cluster:
        raise bad("several hosts are for a cluster (redis+cluster://); a single server takes one host")
    db = 0
    if path:
        if not path.isdigit() or len(path) > 5:
            raise bad(f"the path must be a database number, got {path!r}")
        db = int(path)
        if cluster and db != 0:
            raise bad("Redis Cluster has only database 0")
    return RemoteConfig(tls, cluster, nodes, db, username, password, redacted=shown)


def _parse_node(text: str, bad) -> tuple[str, int]:
    if not text:
        raise bad("no host")
    m = _IPV6_RE.match(text)
    if m:
        host, tail = m.group(1), text[m.end():]
    else:
        host, colon, port_text = text.partition(":")
        tail = f":{port_text}" if colon else ""
        if not _HOST_RE.fullmatch(host):
            raise bad(f"bad host name {host!r}")
    if not tail:
        return host, DEFAULT_PORT
    if not tail.startswith(":") or not tail[1:].isdigit() or not 0 < int(tail[1:]) < 65536:
        raise bad(f"bad port in {text!r} (expected host:1-65535)")
    return host, int(tail[1:])
