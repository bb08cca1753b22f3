"""Where the remote tier's settings come from, and the rule that a shared tier is authenticated.

What the caller passes (Engine arguments, the kernel's MLXCache settings)
comes first, then the environment:

    MLXCACHE_REMOTE_URL                          redis://, rediss://, redis+cluster://...
    MLXCACHE_REMOTE_SECRET, ..._SECRET_FILE      the team secret (openssl rand -base64 32); several lines while
                                                 rotating: the first seals, the others are still read
    MLXCACHE_REMOTE_PASSWORD, ..._PASSWORD_FILE  the server password (or in the URL)
    MLXCACHE_REMOTE_SIGNING_KEY, ..._FILE        this writer's Ed25519 key (writers.py); none: read-only
    MLXCACHE_REMOTE_WRITERS                      the allow-list of writers' public keys (comma-separated)
    MLXCACHE_REMOTE_INSECURE                     1: share an unauthenticated tier, knowingly
    MLXCACHE_REMOTE_TLS_CA_FILE, ..._CERT_FILE, ..._KEY_FILE   a private CA, a client certificate

A `..._FILE` variable names a file holding the value (one trailing newline
dropped), so a credential need never sit in an environment that `%env` or
a child process shows. No secret and no explicit opt-out is refused with a
message saying both ways forward. Nothing here ever shows a credential.
"""

from __future__ import annotations

import ipaddress
import os
import warnings
from dataclasses import dataclass, field
from typing import Mapping

from ...config import Secret, Url, read_secret_file as read_credential_file
from .config import RemoteConfigError, parse_remote_url, redact
from .writers import SigningKey, Writers

TLS_KEYS = ("ca_file", "cert_file", "key_file")


@dataclass(frozen=True)
class RemoteSettings:
    url: str = field(repr=False)
    secret: object = field(default=None, repr=False)  # bytes, str (one per line) or a sequence; None: insecure
    password: str | None = field(default=None, repr=False)
    insecure: bool = False
    tls: dict | None = None
    signing_key: object = field(default=None, repr=False)  # a writers.SigningKey, or None (read-only)
    writers: object = None  # a writers.Writers (empty: any holder of the secret)

    def __repr__(self) -> str:
        auth = "insecure" if self.secret is None else "secret set"
        return (f"RemoteSettings({redact(self.url)!r}, {auth}, password {'set' if self.password else 'not set'}, "
                f"signing key {'set' if self.signing_key is not None else 'not set'}, {self.writers!r})")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def from_env(name: str, env: Mapping[str, str] = os.environ) -> str | None:
    """$name, or the content of the file $name_FILE; None if neither is set."""
    value = env.get(name)
    if value:
        return value
    path = env.get(f"{name}_FILE")
    return read_credential_file(path, f"{name}_FILE") if path else None


def env_flag(name: str, env: Mapping[str, str] = os.environ) -> bool:
    text = (env.get(name) or "").strip().lower()
    if text in ("", "0", "false", "no", "off"):
        return False
    if text in ("1", "true", "yes", "on"):
        return True
    raise RemoteConfigError(f"{name}: expected 0/1 (or true/false), got {text!r}")


def resolve(url: str | None = None, *, secret=None, password: str | None = None, insecure: bool = False,
            tls: dict | None = None, signing_key=None, writers=None,
            env: Mapping[str, str] = os.environ) -> RemoteSettings | None:
    """The remote tier's settings, or None when no URL is configured (the tier is off)."""
    url = url or env.get("MLXCACHE_REMOTE_URL") or None
    if not url:
        return None
    url = url if isinstance(url, Url) else Url(url)  # its repr (a traceback's frames) is redacted
    cfg = parse_remote_url(url)  # a bad URL fails first, and before anything is started
    secret = Secret.wrap(secret or from_env("MLXCACHE_REMOTE_SECRET", env))
    insecure = bool(insecure) or env_flag("MLXCACHE_REMOTE_INSECURE", env)
    if not secret and not insecure:
        raise RemoteConfigError(
            f"remote tier {redact(url)}: no team secret. Set MLXCACHE_REMOTE_SECRET_FILE (or MLXCACHE_REMOTE_SECRET, "
            "or Engine(remote_secret=...)) to a secret of 16+ bytes shared by your team: it keys and signs what "
            "the tier holds. To share an unauthenticated tier anyway (anyone who can write to the server can then "
            "plant KV for your prompts), opt out by name: MLXCACHE_REMOTE_INSECURE=1 or Engine(remote_insecure=True).")
    password = Secret.wrap(password or from_env("MLXCACHE_REMOTE_PASSWORD", env))
    if (cfg.password or password) and not cfg.tls and not all(_loopback(h) for h, _ in cfg.nodes):
        warnings.warn(f"mlxcache: the remote tier {cfg.redacted} is not TLS: its password (and everything the "
                      "tier holds) travels in clear to a host that is not this machine; use rediss://", stacklevel=3)
    tls = dict(tls or {})
    unknown = set(tls) - set(TLS_KEYS)
    if unknown:
        raise RemoteConfigError(f"remote TLS settings: unknown {sorted(unknown)}; use {', '.join(TLS_KEYS)}")
    for key in TLS_KEYS:
        tls[key] = tls.get(key) or env.get(f"MLXCACHE_REMOTE_TLS_{key.upper()}") or None
    for key, path in tls.items():
        if path is not None and not os.path.isfile(os.path.expanduser(str(path))):
            raise RemoteConfigError(f"remote TLS {key} {path} is not a readable file")
    tls = {k: os.path.expanduser(str(v)) for k, v in tls.items() if v is not None}
    signing_key = Secret.wrap(signing_key or from_env("MLXCACHE_REMOTE_SIGNING_KEY", env))
    writers = Writers.parse(writers or env.get("MLXCACHE_REMOTE_WRITERS") or None)
    signing_key = None if not signing_key else SigningKey.load(signing_key)
    return RemoteSettings(url, secret or None, password, insecure and not secret, tls or None, signing_key, writers)
