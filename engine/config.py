"""Every engine option, once: its default, its environment variable, its kernel setting, its help.

`EngineConfig` is the one definition. `Engine(**options)` builds one from
the environment and its keywords (a keyword wins); the kernel's ``MLXCache``
settings (``%config MLXCache.<setting>``, mlxcache_kernel/settings.py) are
derived from its fields, each defaulting to its environment variable; the
table in docs/configuration.md is `option_table()`. Precedence: a keyword (or a kernel
setting) > the environment > the default.

Each field's metadata (`Option`) says how its value reads as text (the form
environment variables and kernel settings take): sizes as ``2GiB``, ``512MB``,
bytes or ``25%`` of memory; flags as 0/1. A secret's environment variable has
a ``_FILE`` twin naming a file that holds it; its kernel setting is that file,
never the secret itself.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping
from .errors import ConfigError, RemoteConfigError  # noqa: F401 (raised here; defined in errors.py)

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z%]*)\s*$")
NONE_WORDS = ("", "none", "off", "unlimited", "null")



class Secret:
    """A credential (team secret, password, signing key) whose repr and str never show it: what a
    traceback's frames, `%config` or a log line print is `Secret(***)`. `reveal()` where it is used."""

    __slots__ = ("_value",)

    def __init__(self, value):
        self._value = value.reveal() if isinstance(value, Secret) else value

    @classmethod
    def wrap(cls, value):
        """`value` as a Secret (None and empty stay as they are)."""
        return value if not value or isinstance(value, Secret) else cls(value)

    def reveal(self):
        return self._value

    def __bool__(self) -> bool:
        return bool(self._value)

    def __eq__(self, other) -> bool:
        return self._value == (other.reveal() if isinstance(other, Secret) else other)

    def __hash__(self) -> int:
        return hash(self._value)

    def __repr__(self) -> str:
        return "Secret(***)"

    __str__ = __repr__

    def __reduce__(self):
        raise TypeError("a secret is not pickled")


def reveal(value):
    """The value inside a Secret (anything else as it is)."""
    return value.reveal() if isinstance(value, Secret) else value


def redact(url) -> str:
    """A URL as it may be shown: whatever precedes the last `@` (user info), and any query
    (`?...`) or fragment (`#...`) after the host, replaced by `***`.

    Takes the last `@` of the whole string, so an unencoded `@`, `/`, `?` or `#` inside a password
    is hidden too (at worst more than the credentials is)."""
    if not isinstance(url, str):
        return "<not a string>"
    url = str.__str__(url)
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    shown = f"{scheme}{sep}***@" if "@" in rest else f"{scheme}{sep}"
    rest = rest.rsplit("@", 1)[-1]
    cut = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=-1)
    return shown + (rest if cut < 0 else rest[:cut] + rest[cut] + "***")


def hide_credentials(keywords: dict) -> None:
    """Wrap, in place, the credentials among Engine keywords: the secrets as Secret, the remote URL
    as Url (so the frames of a failed Engine(...) show them redacted, also under %xmode Verbose)."""
    for name, opt in options().items():
        if opt.kind == "secret" and name in keywords:
            keywords[name] = Secret.wrap(keywords[name])
    if isinstance(keywords.get("remote_url"), str) and not isinstance(keywords["remote_url"], Url):
        keywords["remote_url"] = Url(keywords["remote_url"])


class Url(str):
    """A URL that may hold credentials: itself where it is used, redacted in its repr (tracebacks'
    frames, reprs of what holds it)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return repr(redact(self))


def parse_size(value, *, what: str = "size", allow_none: bool = False) -> int | None:
    """``"2GiB"``, ``"512MB"``, ``"1048576"``, ``"25%"`` (of physical memory) or an int, in bytes.

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
    if text.lower() in NONE_WORDS:
        if allow_none:
            return None
        raise ValueError(f"{what}: a size is required, got {value!r}")
    m = _SIZE.match(text.replace("_", ""))
    if not m:
        raise ValueError(f"{what}: cannot parse {value!r} (use e.g. 2GiB, 512MB, 1073741824 or 25%)")
    number, unit = float(m.group(1)), m.group(2).lower()
    if unit == "%":
        from .host.system import physical_memory

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


def _number(cast, unit: str):
    def parse(value, *, what: str):
        if isinstance(value, bool):
            raise ValueError(f"{what}: expected {unit}, got {value!r}")
        try:
            return cast(value)
        except (TypeError, ValueError):
            raise ValueError(f"{what}: expected {unit}, got {value!r}") from None
    return parse


@dataclass(frozen=True)
class Option:
    """How one EngineConfig field reads as text (environment and kernel settings) and is checked."""

    label: str  # what error messages call it ("RAM budget")
    env: str
    setting: str  # the kernel's MLXCache trait
    kind: str  # size | bool | int | float | text | path | secret (see `read`)
    help: str
    default_text: str  # the default as text (what `%cache config` shows)
    none_word: str = ""  # the text that means None (a size: "auto" or "none"; a float: "0")
    choices: tuple = ()
    off_value: Any = None  # what "off" / "0"-like words mean for a size whose None is "auto" (a prefetch: 0)

    def read(self, value, what: str | None = None) -> Any:
        """A value given as text (or already typed) as the field holds it; ValueError names `what`."""
        what = what or f"{self.label} ({self.env})"
        if isinstance(value, str):
            word = value.strip().lower()
            if self.none_word and word == self.none_word:
                return None
            if self.kind == "size" and word in NONE_WORDS:
                if self.off_value is not None:
                    return self.off_value
                if self.none_word == "none":
                    return None
        if self.kind == "size":
            return parse_size(value, what=what)
        if self.kind == "bool":
            return parse_bool(value, what=what)
        if self.kind == "int":
            return _number(int, "an integer")(value, what=what)
        if self.kind == "float":
            out = _number(float, "a number")(value, what=what)
            return None if self.none_word == "0" and out == 0 else out
        text = value if self.kind == "secret" else str(value).strip()
        if not text:
            return None
        if self.choices:
            if text.lower() not in self.choices:
                raise ValueError(f"{what}: use one of {', '.join(self.choices)}, not {text!r}")
            return text.lower()
        return os.path.expanduser(text) if self.kind == "path" else text


def option(default, kind: str, label: str, help: str, *, none_word: str = "", choices: tuple = (), off_value=None,
           env: str | None = None):
    """A field of EngineConfig. Its kernel setting is the field's name without "_bytes" (a secret's: the
    name + "_file"); its environment variable MLXCACHE_ + the setting in capitals (a secret's: of the name),
    unless `env` says otherwise."""
    text = none_word if default is None else str(int(default) if isinstance(default, bool) else default)
    return field(default=default, metadata={"option": dict(label=label, kind=kind, help=help, default_text=text,
                                                           none_word=none_word, choices=choices, off_value=off_value,
                                                           env=env)})


def _option(name: str, spec: dict) -> Option:
    spec = dict(spec)
    setting = f"{name}_file" if spec["kind"] == "secret" else name.removesuffix("_bytes")
    env = spec.pop("env") or "MLXCACHE_" + (name if spec["kind"] == "secret" else setting).upper()
    return Option(env=env, setting=setting, **spec)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mlxcache-kernel"


def cache_dir_from_env(env: Mapping[str, str] = os.environ) -> Path:
    """The cache directory a kernel started with `env` uses (MLXCACHE_CACHE_DIR, else the default)."""
    return Path(env.get("MLXCACHE_CACHE_DIR") or default_cache_dir()).expanduser()


@dataclass(frozen=True)
class EngineConfig:
    cache_dir: str | None = option(None, "path", "cache directory",
                                   "cache directory (default: ~/.cache/mlxcache-kernel, or under $XDG_CACHE_HOME)")
    ram_budget_bytes: int | None = option(None, "size", "RAM budget", "RAM tier budget: 2GiB, 512MB, bytes or 25% of "
                                          "memory; auto: adapt to the memory the machine has", none_word="auto")
    ssd_budget_bytes: int | None = option(None, "size", "SSD budget", "SSD tier cap (same units; none: no cap)",
                                          none_word="none")
    prefetch_budget_bytes: int | None = option(None, "size", "prefetch budget",
                                               "RAM a model load fills in the background with the most recently "
                                               "used SSD checkpoints (same units; auto: a quarter of the RAM budget; "
                                               "0: off)", none_word="auto", off_value=0)
    ssd: bool = option(True, "bool", "SSD tier", "keep an SSD tier (0: RAM only)")
    ssd_filesystems: str | None = option(None, "text", "SSD filesystems", "filesystem types the SSD tier may use "
                                         "besides the local ones it knows (ext4, xfs, btrfs, zfs, f2fs, bcachefs, "
                                         "tmpfs, overlay; apfs, hfs), comma-separated, as `mount` names them "
                                         "(virtiofs, fuse.mergerfs, ...): knowingly, SQLite's WAL may not be "
                                         "coherent there")
    write_behind: bool = option(True, "bool", "write-behind", "persist checkpoints in the background as they are "
                                "published")
    idle_demote_s: float | None = option(None, "float", "idle demotion", "demote RAM entries unused this many seconds "
                                         "to SSD (0: never)", none_word="0")
    prefill_chunk: int = option(512, "int", "prefill chunk", "prefill chunk size in tokens")
    passage_recompute: float = option(0.15, "float", "passage recompute", "the fraction of the passage tokens "
                                      "generate(..., passages=[...]) places from their cached KV that it recomputes "
                                      "(0 to 1; 1: what a full prefill computes)")
    memory_high_water: float = option(0.85, "float", "memory high-water mark", "share of the memory the kernel may "
                                      "use at which cached state is let go")
    memory_low_water: float = option(0.75, "float", "memory low-water mark", "share it lets go down to (below the "
                                     "high-water mark)")
    retention: str = option("lru", "text", "retention policy", "which RAM entry leaves first: lru or cost (see "
                            "docs/benchmarks.md)", choices=("lru", "cost"))
    trace_path: str | None = option(None, "path", "access trace", "append every cache access to this file (for "
                                    "benchmarks/bench_retention.py)", env="MLXCACHE_TRACE")
    remote_url: str | None = option(None, "text", "remote URL", "a shared tier below SSD: redis://, rediss:// (TLS), "
                                    "redis+cluster://h1:p1,h2:p2 (off unless set; user and password are kept out of "
                                    "the setting)")
    remote_secret: Any = option(None, "secret", "remote team secret", "the team secret (16+ bytes; one per line while "
                                "rotating: the first seals) that keys and signs the tier; the setting is a file "
                                "holding it")
    remote_password: str | None = option(None, "secret", "remote password", "the server password (or in the URL); the "
                                         "setting is a file holding it")
    remote_signing_key: Any = option(None, "secret", "remote signing key", "this writer's Ed25519 private key "
                                     "(base64 of its 32-byte seed, or PEM) that signs what it publishes; none: a "
                                     "read-only member; the setting is a file holding it")
    remote_writers: str | None = option(None, "text", "remote writers", "the team's allow-list: public keys (base64, "
                                        "name=key, comma-separated) whose records are accepted; none: any holder "
                                        "of the team secret")
    remote_insecure: bool = option(False, "bool", "insecure remote", "1: use the tier without a team secret, "
                                   "knowingly (anyone who can write to it can plant KV)")
    remote_tls_ca_file: str | None = option(None, "path", "remote TLS CA", "a private CA for rediss://")
    remote_tls_cert_file: str | None = option(None, "path", "remote TLS certificate", "a client certificate for "
                                              "rediss://")
    remote_tls_key_file: str | None = option(None, "path", "remote TLS key", "its private key")
    remote_publish: str = option("all", "text", "remote publish mode", "which checkpoints go remote: all, named "
                                 "(only %checkpoint save) or none", choices=("all", "named", "none"))

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ, **overrides) -> "EngineConfig":
        """The options the environment sets (a secret also from its ``_FILE``), then `overrides`."""
        values = {}
        for name, opt in options().items():
            raw = env.get(opt.env)
            if opt.kind == "secret" and not raw and env.get(f"{opt.env}_FILE"):
                raw = read_secret_file(env[f"{opt.env}_FILE"], f"{opt.env}_FILE")
            if raw is not None and (raw != "" or opt.kind != "secret"):
                values[name] = opt.read(raw)
        return cls(**values).replace(**overrides)

    def __post_init__(self):
        for name, opt in options().items():  # a credential is held wrapped from here on
            if opt.kind == "secret":
                object.__setattr__(self, name, Secret.wrap(getattr(self, name)))
        if isinstance(self.remote_url, str) and not isinstance(self.remote_url, Url):
            object.__setattr__(self, "remote_url", Url(self.remote_url))

    def replace(self, **changes) -> "EngineConfig":
        """This config with `changes` (Engine keywords); unknown names are a TypeError listing the known."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {', '.join(unknown)}; the options are "
                            f"{', '.join(sorted(known))}")
        return dataclasses.replace(self, **changes)

    def check(self) -> "EngineConfig":
        """ValueError naming the first option out of range."""
        def bad(name: str, why: str):
            opt = options()[name]
            return ConfigError(f"{opt.label} ({name}, {opt.env}, MLXCache.{opt.setting}): {why}")

        if not isinstance(self.prefill_chunk, int) or isinstance(self.prefill_chunk, bool) or self.prefill_chunk < 1:
            raise bad("prefill_chunk", f"must be an integer >= 1, got {self.prefill_chunk!r}")
        if not 0 <= self.passage_recompute <= 1:
            raise bad("passage_recompute", f"must be from 0 to 1, got {self.passage_recompute!r}")
        if not 0 < self.memory_low_water < self.memory_high_water <= 1:
            raise bad("memory_high_water", "memory marks must satisfy 0 < low < high <= 1, got "
                      f"low={self.memory_low_water}, high={self.memory_high_water}")
        for name in ("ram_budget_bytes", "ssd_budget_bytes", "prefetch_budget_bytes"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise bad(name, f"must be a number of bytes >= 0 (or None), got {v!r}")
        if self.idle_demote_s is not None and not self.idle_demote_s > 0:
            raise bad("idle_demote_s", f"must be > 0 seconds (or None: never), got {self.idle_demote_s!r}")
        for name in ("retention", "remote_publish"):
            choices = options()[name].choices
            if getattr(self, name) not in choices:
                raise bad(name, f"use one of {', '.join(choices)}, not {getattr(self, name)!r}")
        return self

    @property
    def remote_tls(self) -> dict | None:
        tls = {k: getattr(self, f"remote_tls_{k}") for k in ("ca_file", "cert_file", "key_file")}
        return {k: v for k, v in tls.items() if v} or None

    def __repr__(self) -> str:  # never the secrets
        shown = [f"{f.name}={'<set>' if options()[f.name].kind == 'secret' else repr(getattr(self, f.name))}"
                 for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]
        return f"EngineConfig({', '.join(shown)})"


def read_secret_file(path, what: str) -> str:
    """The value in `path` (one trailing newline dropped); the error names the file, never its content."""
    try:
        with open(os.path.expanduser(str(path)), encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise RemoteConfigError(f"{what}: cannot read {path} ({type(e).__name__}: "
                                f"{getattr(e, 'strerror', '') or e})") from None
    text = text[:-1] if text.endswith("\n") else text
    if not text.strip():
        raise RemoteConfigError(f"{what}: {path} is empty")
    return text


def options() -> dict[str, Option]:
    """Field name -> Option, in the dataclass's order."""
    return {f.name: _option(f.name, f.metadata["option"]) for f in dataclasses.fields(EngineConfig)}


def option_table(kernel_only: dict[str, Option] | None = None) -> str:
    """The Markdown table of every option (docs/configuration.md): keyword, variable, setting, default, meaning."""
    rows = ["| `Engine(...)` keyword | environment variable | kernel setting | default | meaning |",
            "|---|---|---|---|---|"]
    every = [(f"`{name}`", opt) for name, opt in options().items()]
    every += [("(kernel only)", opt) for opt in (kernel_only or {}).values()]
    for keyword, opt in every:
        env = f"`{opt.env}`" + (f" (or `{opt.env}_FILE`)" if opt.kind == "secret" else "")
        rows.append(f"| {keyword} | {env} | `{opt.setting}` | {opt.default_text or '—'} | {opt.help} |")
    return "\n".join(rows)
