"""Kernel settings: the engine's options (engine/config.py) as ``MLXCache`` traits, plus the kernel's own.

Every option has an environment variable (read when the settings object is
created) and a trait on the ``MLXCache`` configurable, so a profile's
``ipython_kernel_config.py`` (or ``%config MLXCache.ram_budget = "2GiB"``
before the first generation) can set it too. The traits are derived from
`EngineConfig`'s fields: the table of every option is in docs/configuration.md
(`option_table()`), and ``%config MLXCache`` lists them with their help.

Credentials never sit in a trait, so neither ``%config MLXCache`` nor a saved
notebook can show them: the secret and the password come from the
environment or from files (their traits are the files); a password in a URL
is moved out of the trait when the URL is set (and setting one in a notebook
cell warns: the cell is saved with the notebook).
"""

from __future__ import annotations

import dataclasses
import os
import warnings

from traitlets import Bool, Float, Int, Unicode, default, validate
from traitlets.config import Configurable

from mlxcache_kernel.engine.config import (NONE_WORDS, EngineConfig, Option, Secret, options, parse_bool, parse_size,
                                           read_secret_file)

__all__ = ["MLXCache", "KERNEL_OPTIONS", "parse_bool", "parse_size", "redact_env_magic", "resolve_model_spec"]

DEFAULT_MODEL_ALIAS = "smollm2"
# The kernel's own settings (not the engine's), described as the engine's are.
KERNEL_OPTIONS = {
    "default_model": Option("default model", "MLXCACHE_DEFAULT_MODEL", "default_model", "text",
                            "model loaded on first use: a path, a hub id, smollm2 (the bundled SmolLM2-135M-Instruct) "
                            "or none", DEFAULT_MODEL_ALIAS),
    "shutdown_flush_s": Option("shutdown flush", "MLXCACHE_SHUTDOWN_FLUSH_S", "shutdown_flush_s", "float",
                               "seconds kernel shutdown waits for pending writes", "3.5"),
}
_TRAIT_TYPES = {"bool": Bool, "int": Int, "float": Float}


def _trait_value(opt: Option, raw: str):
    """Text from the environment as the trait holds it (typed traits parse; the rest stay text)."""
    if opt.kind == "bool":
        return parse_bool(raw, what=opt.env)
    if opt.kind in ("int", "float"):
        value = opt.read(raw)
        return 0.0 if value is None else value  # (a float whose 0 means "never")
    return raw


def _settings_traits() -> dict:
    """One trait per engine option and kernel option, each defaulting to its environment variable."""
    ns = {}
    every = {**{name: opt for name, opt in options().items()}, **KERNEL_OPTIONS}
    for opt in every.values():
        if opt.kind == "secret":  # the trait is the file; the secret itself only ever in the environment
            env, help = f"{opt.env}_FILE", f"a file holding {opt.help.split(';')[0]} (${opt.env}_FILE; or the value " \
                                              f"itself in ${opt.env})"
        else:
            env, help = opt.env, f"{opt.help} (${opt.env})"
        ns[opt.setting] = _TRAIT_TYPES.get(opt.kind, Unicode)(help=help).tag(config=True)
        if opt.setting in ("remote_url", "cache_dir"):
            ns[f"_{opt.setting}_default"] = default(opt.setting)(getattr(_Settings, f"_{opt.setting}_from_env"))
            continue

        def read(self, opt=opt, env=env):
            raw = os.environ.get(env)
            return _trait_value(opt, opt.default_text if raw is None else raw) if opt.kind != "secret" else (raw or "")

        ns[f"_{opt.setting}_default"] = default(opt.setting)(read)
    return ns


class _Settings(Configurable):
    """Settings of the MLX cache kernel and the ``%load_ext mlxcache_kernel`` magics."""

    def __init__(self, **kwargs):
        self._url_userinfo = ""  # "user:password" taken out of remote_url (never in a trait)
        self._url_tail = ""  # its "?query#fragment", likewise
        super().__init__(**kwargs)
        self._ready = True  # from here on, a URL with a password was typed in (a notebook cell)

    def _cache_dir_from_env(self):
        from mlxcache_kernel.engine.config import cache_dir_from_env

        return str(cache_dir_from_env())

    def _remote_url_from_env(self):
        return self._keep_userinfo(os.environ.get("MLXCACHE_REMOTE_URL", ""))

    @validate("remote_url")
    def _remote_url_valid(self, proposal):
        url = self._keep_userinfo(proposal["value"])
        if ":" in self._url_userinfo and getattr(self, "_ready", False):
            warnings.warn("a password set in a notebook is saved with it: put it in MLXCACHE_REMOTE_PASSWORD_FILE "
                          "(or MLXCACHE_REMOTE_PASSWORD) and leave it out of the URL", stacklevel=2)
        return url

    def _keep_userinfo(self, url: str) -> str:
        """`url` without its user and password, query and fragment (any may hold a credential),
        which are kept aside for engine_config(): %config shows the trait."""
        scheme, sep, rest = url.strip().partition("://")
        userinfo, at, host = rest.rpartition("@")
        self._url_userinfo = userinfo if sep and at else ""
        shown = f"{scheme}{sep}{host}" if sep and at else url.strip()
        cut = min((i for i in (shown.find("?"), shown.find("#")) if i >= 0), default=len(shown))
        self._url_tail = shown[cut:]
        return shown[:cut]

    def _full_url(self) -> str:
        """The remote URL as typed: the trait with its user info, query and fragment put back."""
        url = self.remote_url.strip()
        if url and self._url_userinfo:
            scheme, _, rest = url.partition("://")
            url = f"{scheme}://{self._url_userinfo}@{rest}"
        return url + self._url_tail if url else url

    # --- resolved values ---

    def _option(self, name: str):
        opt = options()[name]
        return opt.read(getattr(self, opt.setting), what=f"{opt.label} ({opt.env}, MLXCache.{opt.setting})")

    def ram_budget_bytes(self) -> int | None:
        """None for 'auto': no fixed cap; the engine lets entries go when the machine runs short."""
        return self._option("ram_budget_bytes")

    def ssd_budget_bytes(self) -> int | None:
        return self._option("ssd_budget_bytes")

    def prefetch_budget_bytes(self) -> int | None:
        """None for 'auto' (the engine's default: a quarter of the RAM budget); 0 turns prefetch off."""
        return self._option("prefetch_budget_bytes")

    def default_model_spec(self) -> str | None:
        spec = (self.default_model or "").strip()
        return None if spec.lower() in NONE_WORDS else spec

    def engine_config(self) -> EngineConfig:
        """The Engine's options from these settings, credentials read now (from files or the
        environment); raises ValueError naming a bad setting."""
        values = {}
        for name, opt in options().items():
            if opt.kind == "secret":
                path = getattr(self, opt.setting)
                values[name] = Secret.wrap(os.environ.get(opt.env) or (read_secret_file(path, f"{opt.env}_FILE")
                                                                        if path else None))
            elif name != "remote_url":
                values[name] = self._option(name)
        url = self._full_url()
        values["remote_url"] = url or None
        if not url:  # no tier: no credentials read or held
            values["remote_secret"] = values["remote_password"] = values["remote_signing_key"] = None
        return EngineConfig(**values).check()

    def engine_kwargs(self) -> dict:
        """engine_config() as Engine keywords."""
        config = self.engine_config()
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}

    def summary(self) -> dict:
        """Settings as shown by ``%cache config`` (sizes resolved where they parse; no credential)."""
        from mlxcache_kernel.engine.cache.remote.config import redact

        out = {}
        for name, opt in {**options(), **KERNEL_OPTIONS}.items():
            if opt.kind == "secret":
                path, what = getattr(self, opt.setting), opt.setting.removesuffix("_file")
                out[what] = (f"set (${opt.env})" if os.environ.get(opt.env) else f"from {path}" if path else
                             "in the URL" if what == "remote_password" and ":" in self._url_userinfo else "not set")
            elif name == "remote_url":
                out["remote_url"] = redact(self._full_url()) if self.remote_url.strip() else "off"
            else:
                value = getattr(self, opt.setting)
                out[opt.setting] = value if value != "" or opt.kind != "path" else "none"
        for name in ("ram_budget_bytes", "ssd_budget_bytes", "prefetch_budget_bytes"):
            try:
                out[name] = getattr(self, name)()
            except ValueError as e:
                out[name] = f"invalid: {e}"
        return out


MLXCache = type("MLXCache", (_Settings,), {"__doc__": _Settings.__doc__, "__module__": __name__,
                                           **_settings_traits()})


CREDENTIAL_VARS = ("MLXCACHE_REMOTE_PASSWORD", "MLXCACHE_REMOTE_SECRET", "MLXCACHE_REMOTE_SIGNING_KEY")


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
        from mlxcache_kernel.engine.models.convert import ensure_default_model

        return str(ensure_default_model())
    return os.path.expanduser(spec)
