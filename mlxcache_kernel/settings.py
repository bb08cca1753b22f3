"""Kernel settings: built-in defaults < environment variables < IPython config.

Every setting has an environment variable (read when the settings object is
created) and a trait on the ``MLXCache`` configurable, so a profile's
``ipython_kernel_config.py`` (or ``%config MLXCache.ram_budget = "2GiB"``
before the first generation) can set it too:

==========================  ========================  ===========================================
environment variable        config trait              meaning
==========================  ========================  ===========================================
MLXCACHE_CACHE_DIR          MLXCache.cache_dir        cache directory (default: the user cache
                                                      dir, ``~/.cache/mlxcache-kernel``)
MLXCACHE_RAM_BUDGET         MLXCache.ram_budget       RAM tier budget: ``2GiB``, ``512MB``, bytes
                                                      or ``25%`` of physical memory (default 25%)
MLXCACHE_SSD_BUDGET         MLXCache.ssd_budget       SSD tier cap (same units; ``none`` = no cap)
MLXCACHE_PREFETCH_BUDGET    MLXCache.prefetch_budget  how much recently used SSD state a model load
                                                      brings back into RAM in the background (same
                                                      units; ``auto``: a quarter of the RAM budget;
                                                      ``0``/``off``: no prefetch)
MLXCACHE_SSD                MLXCache.ssd              ``0`` turns the SSD tier off
MLXCACHE_WRITE_BEHIND       MLXCache.write_behind     ``0``/``1``: persist checkpoints in the
                                                      background as they are published
MLXCACHE_DEFAULT_MODEL      MLXCache.default_model    loaded on first use: a path, a hub id,
                                                      ``smollm2`` (the bundled SmolLM2-135M-
                                                      Instruct) or ``none``
MLXCACHE_PREFILL_CHUNK      MLXCache.prefill_chunk    prefill chunk size in tokens (default 512)
MLXCACHE_SHUTDOWN_FLUSH_S   MLXCache.shutdown_flush_s how long shutdown waits for pending writes
MLXCACHE_REMOTE_URL         MLXCache.remote_url       a shared tier below SSD: ``redis://``,
                                                      ``rediss://`` (TLS), ``redis+cluster://``
                                                      (off unless set; shown as ``redis://***@host``)
MLXCACHE_REMOTE_SECRET_FILE MLXCache.remote_secret_   a file holding the team secret (16+ bytes;
                            file                      one per line while rotating: the first seals)
                                                      that keys and signs the tier; or the secret
                                                      itself in MLXCACHE_REMOTE_SECRET
MLXCACHE_REMOTE_PASSWORD_   MLXCache.remote_password_ a file holding the server password; or the
FILE                        file                      password in MLXCACHE_REMOTE_PASSWORD
MLXCACHE_REMOTE_INSECURE    MLXCache.remote_insecure  ``1``: use the tier without a secret, knowingly
                                                      (anyone who can write to it can plant KV)
MLXCACHE_REMOTE_TLS_CA_FILE MLXCache.remote_tls_ca_   a private CA for ``rediss://``; ``..._CERT_
                            file (cert_file, key_file) FILE`` and ``..._KEY_FILE``: a client certificate
MLXCACHE_REMOTE_PUBLISH     MLXCache.remote_publish   ``all`` (default), ``named`` or ``none``
==========================  ========================  ===========================================

Credentials never sit in a trait, so neither ``%config MLXCache`` nor a saved
notebook can show them: the secret and the password come from the
environment or from files; a password in a URL is moved out of the trait
when the URL is set (and setting one in a notebook cell warns: the cell is
saved with the notebook).
"""

from __future__ import annotations

import os
import re
import warnings

from traitlets import Bool, Float, Int, Unicode, default, validate
from traitlets.config import Configurable

DEFAULT_MODEL_ALIAS = "smollm2"
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z%]*)\s*$")
_NONE = ("", "none", "off", "unlimited", "null")


def parse_size(value, *, what: str = "size", allow_none: bool = False) -> int | None:
    """Parse ``"2GiB"``, ``"512MB"``, ``"1048576"``, ``"25%"`` (of physical memory) or an int.

    ``none``/``off``/``unlimited`` (or an empty string) give None when
    ``allow_none``. Raises ValueError with a message naming ``what``.
    """
    if value is None:
        if allow_none:
            return None
        raise ValueError(f"{what}: a size is required")
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a size, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"{what}: must not be negative, got {value!r}")
        return int(value)
    text = str(value).strip()
    if text.lower() in _NONE:
        if allow_none:
            return None
        raise ValueError(f"{what}: a size is required, got {value!r}")
    m = _SIZE.match(text.replace("_", ""))
    if not m:
        raise ValueError(f"{what}: cannot parse {value!r} (use e.g. 2GiB, 512MB, 1073741824 or 25%)")
    number, unit = float(m.group(1)), m.group(2).lower()
    if unit == "%":
        from mlxcache_kernel.engine.system import physical_memory  # MLX loads with the engine, not before

        mem = physical_memory()
        if mem is None:
            raise ValueError(f"{what}: {value!r} is a share of physical memory, which is unknown here")
        if not 0 < number <= 100:
            raise ValueError(f"{what}: a percentage must be in (0, 100], got {value!r}")
        return int(mem * number / 100)
    if unit not in _UNITS:
        raise ValueError(f"{what}: unknown unit {m.group(2)!r} in {value!r} (use B, KB, MB, GB, KiB, MiB, GiB)")
    return int(number * _UNITS[unit])


def parse_bool(value, *, what: str = "flag") -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{what}: expected 0/1 (or true/false), got {value!r}")


def _number(name: str, raw: str, cast, unit: str):
    try:
        return cast(raw)
    except ValueError:
        raise ValueError(f"{name}: expected {unit}, got {raw!r}") from None


def _env(name: str, fallback: str) -> str:
    value = os.environ.get(name)
    return fallback if value is None else value


def _from_env(trait: str, env: str, fallback: str, parse=None):
    """A trait's dynamic default: `env` (or `fallback`), parsed, read when the settings are created."""

    @default(trait)
    def read(self):
        raw = _env(env, fallback)
        return raw if parse is None else parse(raw, env)

    return read


class MLXCache(Configurable):
    """Settings of the MLX cache kernel and the ``%load_ext mlxcache_kernel`` magics."""

    cache_dir = Unicode(help="Cache directory ($MLXCACHE_CACHE_DIR; default ~/.cache/mlxcache-kernel)").tag(
        config=True
    )
    ram_budget = Unicode(
        help="RAM tier budget: 'auto' (adapt to the memory the machine has), '2GiB', '512MB', bytes or "
             "'25%' of memory ($MLXCACHE_RAM_BUDGET)"
    ).tag(config=True)
    ssd_budget = Unicode(help="SSD tier cap, same units, 'none' for no cap ($MLXCACHE_SSD_BUDGET)").tag(config=True)
    prefetch_budget = Unicode(
        help="RAM a model load fills in the background with the most recently used SSD checkpoints: 'auto' "
             "(a quarter of the RAM budget), '512MB', bytes, '5%' of memory, or '0'/'off' ($MLXCACHE_PREFETCH_BUDGET)"
    ).tag(config=True)
    ssd = Bool(help="Keep an SSD tier ($MLXCACHE_SSD)").tag(config=True)
    write_behind = Bool(help="Persist checkpoints in the background ($MLXCACHE_WRITE_BEHIND)").tag(config=True)
    default_model = Unicode(
        help="Model loaded on first use: a path, a hub id, 'smollm2' or 'none' ($MLXCACHE_DEFAULT_MODEL)"
    ).tag(config=True)
    prefill_chunk = Int(help="Prefill chunk size in tokens ($MLXCACHE_PREFILL_CHUNK)").tag(config=True)
    shutdown_flush_s = Float(
        help="Seconds kernel shutdown waits for pending writes ($MLXCACHE_SHUTDOWN_FLUSH_S)"
    ).tag(config=True)
    idle_demote_s = Float(
        help="Demote RAM entries unused this many seconds to SSD; 0 = never ($MLXCACHE_IDLE_DEMOTE_S)"
    ).tag(config=True)
    remote_url = Unicode(
        help="Shared remote tier (Redis / Valkey) URL; '' = off ($MLXCACHE_REMOTE_URL). User and password are "
             "kept out of this setting (the password belongs in $MLXCACHE_REMOTE_PASSWORD_FILE)."
    ).tag(config=True)
    remote_secret_file = Unicode(
        help="File holding the team secret that keys and signs the remote tier ($MLXCACHE_REMOTE_SECRET_FILE; "
             "or the secret itself in $MLXCACHE_REMOTE_SECRET)"
    ).tag(config=True)
    remote_password_file = Unicode(
        help="File holding the remote server's password ($MLXCACHE_REMOTE_PASSWORD_FILE; or $MLXCACHE_REMOTE_PASSWORD)"
    ).tag(config=True)
    remote_insecure = Bool(
        help="Use the remote tier without a team secret: unauthenticated ($MLXCACHE_REMOTE_INSECURE)"
    ).tag(config=True)
    remote_tls_ca_file = Unicode(help="Private CA for rediss:// ($MLXCACHE_REMOTE_TLS_CA_FILE)").tag(config=True)
    remote_tls_cert_file = Unicode(help="Client certificate for rediss:// ($MLXCACHE_REMOTE_TLS_CERT_FILE)").tag(
        config=True
    )
    remote_tls_key_file = Unicode(help="Its private key ($MLXCACHE_REMOTE_TLS_KEY_FILE)").tag(config=True)
    remote_publish = Unicode(help="Which checkpoints go remote: all, named, none ($MLXCACHE_REMOTE_PUBLISH)").tag(
        config=True
    )

    def __init__(self, **kwargs):
        self._url_userinfo = ""  # "user:password" taken out of remote_url (never in a trait)
        super().__init__(**kwargs)
        self._ready = True  # from here on, a URL with a password was typed in (a notebook cell)

    @default("remote_url")
    def _remote_url_default(self):
        return self._keep_userinfo(_env("MLXCACHE_REMOTE_URL", ""))

    @validate("remote_url")
    def _remote_url_valid(self, proposal):
        url = self._keep_userinfo(proposal["value"])
        if ":" in self._url_userinfo and getattr(self, "_ready", False):
            warnings.warn("a password set in a notebook is saved with it: put it in MLXCACHE_REMOTE_PASSWORD_FILE "
                          "(or MLXCACHE_REMOTE_PASSWORD) and leave it out of the URL", stacklevel=2)
        return url

    def _keep_userinfo(self, url: str) -> str:
        """`url` without its user and password, which are kept aside for engine_kwargs()."""
        scheme, sep, rest = url.strip().partition("://")
        userinfo, at, host = rest.rpartition("@")
        self._url_userinfo = userinfo if sep and at else ""
        return f"{scheme}{sep}{host}" if sep and at else url.strip()

    @default("cache_dir")
    def _cache_dir_default(self):
        from mlxcache_kernel.engine.engine import default_cache_dir

        return _env("MLXCACHE_CACHE_DIR", "") or str(default_cache_dir())

    # Each setting's default is its environment variable, read when the settings are created.
    _ram_budget_default = _from_env("ram_budget", "MLXCACHE_RAM_BUDGET", "auto")
    _ssd_budget_default = _from_env("ssd_budget", "MLXCACHE_SSD_BUDGET", "none")
    _prefetch_budget_default = _from_env("prefetch_budget", "MLXCACHE_PREFETCH_BUDGET", "auto")
    _ssd_default = _from_env("ssd", "MLXCACHE_SSD", "1", lambda raw, env: parse_bool(raw, what=env))
    _write_behind_default = _from_env("write_behind", "MLXCACHE_WRITE_BEHIND", "1",
                                      lambda raw, env: parse_bool(raw, what=env))
    _default_model_default = _from_env("default_model", "MLXCACHE_DEFAULT_MODEL", DEFAULT_MODEL_ALIAS)
    _prefill_chunk_default = _from_env("prefill_chunk", "MLXCACHE_PREFILL_CHUNK", "512",
                                       lambda raw, env: _number(env, raw, int, "a number of tokens"))
    _shutdown_flush_default = _from_env("shutdown_flush_s", "MLXCACHE_SHUTDOWN_FLUSH_S", "3.5",
                                        lambda raw, env: _number(env, raw, float, "seconds"))
    _idle_demote_default = _from_env("idle_demote_s", "MLXCACHE_IDLE_DEMOTE_S", "0",
                                     lambda raw, env: _number(env, raw, float, "seconds"))
    _remote_secret_file_default = _from_env("remote_secret_file", "MLXCACHE_REMOTE_SECRET_FILE", "")
    _remote_password_file_default = _from_env("remote_password_file", "MLXCACHE_REMOTE_PASSWORD_FILE", "")
    _remote_insecure_default = _from_env("remote_insecure", "MLXCACHE_REMOTE_INSECURE", "0",
                                         lambda raw, env: parse_bool(raw, what=env))
    _remote_tls_ca_default = _from_env("remote_tls_ca_file", "MLXCACHE_REMOTE_TLS_CA_FILE", "")
    _remote_tls_cert_default = _from_env("remote_tls_cert_file", "MLXCACHE_REMOTE_TLS_CERT_FILE", "")
    _remote_tls_key_default = _from_env("remote_tls_key_file", "MLXCACHE_REMOTE_TLS_KEY_FILE", "")
    _remote_publish_default = _from_env("remote_publish", "MLXCACHE_REMOTE_PUBLISH", "all")

    # --- resolved values ---

    def ram_budget_bytes(self) -> int | None:
        """None for 'auto': no fixed cap; the engine lets entries go when the machine runs short."""
        if self.ram_budget.strip().lower() == "auto":
            return None
        return parse_size(self.ram_budget, what="RAM budget (MLXCACHE_RAM_BUDGET)")

    def ssd_budget_bytes(self) -> int | None:
        return parse_size(self.ssd_budget, what="SSD budget (MLXCACHE_SSD_BUDGET)", allow_none=True)

    def prefetch_budget_bytes(self) -> int | None:
        """None for 'auto' (the engine's default: a quarter of the RAM budget); 0 turns prefetch off."""
        text = self.prefetch_budget.strip().lower()
        if text == "auto":
            return None
        if text in _NONE:
            return 0
        return parse_size(self.prefetch_budget, what="prefetch budget (MLXCACHE_PREFETCH_BUDGET)")

    def default_model_spec(self) -> str | None:
        spec = (self.default_model or "").strip()
        return None if spec.lower() in _NONE else spec

    def engine_kwargs(self) -> dict:
        """Arguments for ``Engine(...)``; raises ValueError naming a bad setting."""
        if self.prefill_chunk <= 0:
            raise ValueError(f"prefill chunk (MLXCACHE_PREFILL_CHUNK) must be positive, got {self.prefill_chunk}")
        return {
            "cache_dir": os.path.expanduser(self.cache_dir),
            "ram_budget_bytes": self.ram_budget_bytes(),
            "ssd_budget_bytes": self.ssd_budget_bytes(),
            "prefetch_budget_bytes": self.prefetch_budget_bytes(),
            "ssd": bool(self.ssd),
            "write_behind": bool(self.write_behind),
            "prefill_chunk": int(self.prefill_chunk),
            "idle_demote_s": float(self.idle_demote_s) if self.idle_demote_s > 0 else None,
            **self._remote_kwargs(),
        }

    def _remote_kwargs(self) -> dict:
        """The remote tier's Engine arguments, credentials read now (from files or the environment)."""
        from mlxcache_kernel.engine.cache.remote.credentials import read_credential_file

        url = self.remote_url.strip()
        if url and self._url_userinfo:
            scheme, _, rest = url.partition("://")
            url = f"{scheme}://{self._url_userinfo}@{rest}"

        def credential(name: str, path: str) -> str | None:
            return os.environ.get(name) or (read_credential_file(path, f"{name}_FILE") if path else None)

        return {
            "remote_url": url or None,
            "remote_secret": credential("MLXCACHE_REMOTE_SECRET", self.remote_secret_file) if url else None,
            "remote_password": credential("MLXCACHE_REMOTE_PASSWORD", self.remote_password_file) if url else None,
            "remote_insecure": bool(self.remote_insecure),
            "remote_tls": {k: getattr(self, f"remote_tls_{k}") for k in ("ca_file", "cert_file", "key_file")
                           if getattr(self, f"remote_tls_{k}")} or None,
            "remote_publish": self.remote_publish.strip().lower() or "all",
        }

    def summary(self) -> dict:
        """Settings as shown by ``%cache config`` (sizes resolved where they parse)."""
        out = {}
        for name in ("cache_dir", "ram_budget", "ssd_budget", "prefetch_budget", "ssd", "write_behind",
                     "default_model", "prefill_chunk", "shutdown_flush_s", "idle_demote_s"):
            out[name] = getattr(self, name)
        from mlxcache_kernel.engine.cache.remote.config import redact

        url = self.remote_url.strip()
        out["remote_url"] = redact(f"{url.partition('://')[0]}://{self._url_userinfo}@{url.partition('://')[2]}"
                                   if self._url_userinfo else url) if url else "off"
        for what, env, path in (("secret", "MLXCACHE_REMOTE_SECRET", self.remote_secret_file),
                                ("password", "MLXCACHE_REMOTE_PASSWORD", self.remote_password_file)):
            out[f"remote_{what}"] = (f"set (${env})" if os.environ.get(env) else f"from {path}" if path else
                                     "in the URL" if what == "password" and ":" in self._url_userinfo else "not set")
        out["remote_insecure"] = bool(self.remote_insecure)
        for k in ("ca_file", "cert_file", "key_file"):
            out[f"remote_tls_{k}"] = getattr(self, f"remote_tls_{k}") or "none"
        out["remote_publish"] = self.remote_publish
        for name in ("ram_budget_bytes", "ssd_budget_bytes", "prefetch_budget_bytes"):
            try:
                out[name] = getattr(self, name)()
            except ValueError as e:
                out[name] = f"invalid: {e}"
        return out


CREDENTIAL_VARS = ("MLXCACHE_REMOTE_PASSWORD", "MLXCACHE_REMOTE_SECRET")


def shown_env(name: str, value):
    """An environment variable as ``%env`` may show it: credentials hidden, the remote URL redacted."""
    if name in CREDENTIAL_VARS:
        return "<hidden>"
    if name == "MLXCACHE_REMOTE_URL" and isinstance(value, str):
        from mlxcache_kernel.engine.cache.remote.config import redact

        return redact(value)
    return value


def redact_env_magic(ipython) -> None:
    """Make ``%env`` (which hides only *KEY*, *TOKEN* and *SECRET* names) hide the remote
    tier's password and the credentials in its URL too: its output is saved in the notebook."""
    original = ipython.find_line_magic("env")
    if original is None or getattr(original, "_mlxcache", False):
        return

    def env(line=""):
        out = original(line)
        if isinstance(out, dict):
            return {k: shown_env(k, v) for k, v in out.items()}
        name = line.strip()
        return shown_env(name, out) if name and " " not in name and "=" not in name else out

    env._mlxcache, env._original = True, original  # unload_ipython_extension puts the original back
    env.__doc__ = original.__doc__
    ipython.register_magic_function(env, "line", "env")


def resolve_model_spec(spec: str) -> str:
    """``smollm2`` (any case) means the converted default model; anything else is passed through."""
    if spec.strip().lower() in (DEFAULT_MODEL_ALIAS, "default:smollm2", "smollm2-135m-instruct"):
        from mlxcache_kernel.engine.convert import ensure_default_model

        return str(ensure_default_model())
    return os.path.expanduser(spec)
