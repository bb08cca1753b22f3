"""IPython magics over one lazily created Engine.

``%model``, ``%%generate``, ``%session``, ``%checkpoint``, ``%cache``, ``%kv``
and ``%dashboard``. Arguments are parsed with IPython's magic_arguments, so
``%%generate?`` shows the help. Every bad option, unknown name, missing
model or empty cell ends in one UsageError line; the engine keeps working.

Prompt interpolation (``%%generate``): ``{name}`` is replaced by ``str(value)``
when ``name`` is a plain identifier bound in the user namespace to a value
(not a module, function or class, and not one of IPython's hidden names such
as ``In``/``Out``). Every other brace stays as written, so documents, JSON and
code can be pasted as they are. ``{{name}}`` writes a literal ``{name}``
(the one escape, for the rare text that mentions a defined variable in
braces); any other ``{{``/``}}`` is left untouched. ``--literal`` turns
interpolation off.
"""

from __future__ import annotations

import functools
import html
import inspect
import re
import sys
import time
import types

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display

from mlxcache_kernel.widgets.format import fmt_bytes as format_bytes

from .settings import MLXCache, resolve_model_spec

_FIELD = re.compile(r"\{\{([A-Za-z_][A-Za-z0-9_]*)\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}")
_NOT_VALUES = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, type)


def interpolate(text: str, namespace: dict, hidden: set | frozenset = frozenset()) -> str:
    """Substitute ``{name}`` for values bound in ``namespace``; ``{{name}}`` -> ``{name}``."""

    def sub(m: re.Match) -> str:
        if m.group(1) is not None:
            return "{" + m.group(1) + "}"
        name = m.group(2)
        if name.startswith("_") or name in hidden or name not in namespace:
            return m.group(0)
        value = namespace[name]
        if isinstance(value, _NOT_VALUES):
            return m.group(0)
        return str(value)

    return _FIELD.sub(sub, text)


def _usage_errors(func):
    """Turn the engine's one-line ValueErrors (and friends) into a UsageError."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except UsageError:
            raise
        except (ValueError, LookupError, OSError) as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UsageError(msg) from None
        except RuntimeError as e:
            if "closed" in str(e):
                raise UsageError(str(e)) from None
            raise

    # keep magic_arguments' parser (and the help text) reachable on the wrapper
    return wrapper


def _parse(magic, line: str):
    """Like magic_arguments.parse_argstring, but quotes group words and are removed (POSIX rules)."""
    from IPython.utils._process_common import arg_split

    try:
        argv = arg_split(line, posix=True, strict=True)
    except ValueError as e:
        raise UsageError(f"cannot parse the options: {e}") from None
    return magic.parser.parse_args(argv)


def _fmt_s(x) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def _show_table(rows: list[dict], columns: list[str], *, empty: str = "(none)") -> None:
    """Display rows as a plain-text table (with an HTML rendering for rich front ends)."""
    if not rows:
        print(empty)
        return
    cells = [[("" if r.get(c) is None else str(r.get(c))) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    text = "\n".join(lines)
    head = "".join(f"<th style='text-align:left'>{html.escape(c)}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td style='text-align:left'>{html.escape(v)}</td>" for v in row) + "</tr>" for row in cells
    )
    display({"text/plain": text, "text/html": f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"},
            raw=True)


class Generation:
    """What ``%%generate`` returns (and stores in ``--out``).

    ``.text``, ``.tokens`` (generated ids), ``.stats`` (dict), ``.prompt`` (the
    interpolated cell), ``.model``, ``.session``. Displays as the cell footer;
    ``str()`` is the text.
    """

    def __init__(self, result, *, prompt: str, model: str | None, session: str | None, use_cache: bool):
        self.result = result
        self.text = result.text
        self.tokens = list(result.tokens)
        self.stats = dict(result.stats)
        self.prompt = prompt
        self.model = model
        self.session = session
        self.use_cache = use_cache

    def __str__(self) -> str:
        return self.text

    def footer(self) -> str:
        s = self.stats
        n = s.get("prompt_tokens", 0)
        prompt = (
            f"{n} prompt tokens: {s.get('ram_tokens', 0)} from RAM, {s.get('ssd_tokens', 0)} from SSD, "
            f"{s.get('prefilled_tokens', n)} prefilled" + ("" if self.use_cache else " (cache off)")
        )
        tps = s.get("decode_tokens_per_s")
        parts = [
            prompt,
            f"TTFT {_fmt_s(s.get('ttft_s'))}",
            f"{s.get('decode_tokens', len(self.tokens))} tokens at {tps:.1f} tok/s" if tps
            else f"{s.get('decode_tokens', len(self.tokens))} tokens",
            f"finish: {s.get('finish_reason', '?')}",
        ]
        resumed = s.get("resumed_from")
        if resumed:
            parts.insert(1, f"resumed from an in-flight checkpoint at token {resumed}")
        tail = f"model {self.model}" + (f", session {self.session}" if self.session else "")
        return "[mlxcache] " + " · ".join(parts) + f" · {tail}"

    def __repr__(self) -> str:
        return self.footer()

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(self.footer())

    def _repr_html_(self) -> str:
        return (
            "<div style='font-size:85%;color:#666;border-top:1px solid #ddd;padding-top:2px'>"
            f"{html.escape(self.footer())}</div>"
        )


class _Progress:
    """A progress display created on the first callback: the widget, or text.

    Only in a kernel (a front end that can update displays in place); a
    terminal IPython gets no progress display.
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.widget = None
        self.handle = None
        self.last_text = 0.0

    def __call__(self, phase: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.handle is None:
            if done >= total:  # already finished (a short prompt): nothing to watch
                return
            try:
                from mlxcache_kernel.widgets import GenerationProgress

                self.widget = GenerationProgress()
                self.handle = display(self.widget, display_id=True)
            except Exception:
                self.widget = None
                self.handle = display({"text/plain": ""}, raw=True, display_id=True)
        if self.widget is not None:
            self.widget.update(phase, done, total)
        elif self.handle is not None:
            now = time.monotonic()
            if now - self.last_text > 0.25 or done >= total:
                self.last_text = now
                word = "restoring from SSD" if phase == "restore" else "prefill"
                self.handle.update({"text/plain": f"{word}: {done}/{total} tokens"}, raw=True)

    def close(self) -> None:
        if self.widget is not None:
            try:
                self.widget.finish()
                self.widget.close()
            except Exception:
                pass
            self.widget = None
        if self.handle is not None:
            # Replace the output in place, so a saved notebook holds no dead widget view.
            self.handle.update({"text/plain": ""}, raw=True)
            self.handle = None


class _Stream:
    """Writes generated text to the cell output as it arrives (main thread)."""

    def __init__(self):
        self.chars = 0
        self.last_char = "\n"
        self.last_flush = time.monotonic()

    def __call__(self, piece: str) -> None:
        if not piece:
            return
        out = sys.stdout
        out.write(piece)
        self.chars += len(piece)
        self.last_char = piece[-1]
        now = time.monotonic()
        if now - self.last_flush > 0.1:
            self.last_flush = now
            try:
                out.flush()
            except Exception:
                pass

    def end(self) -> None:
        if self.chars and self.last_char != "\n":
            sys.stdout.write("\n")
        try:
            sys.stdout.flush()
        except Exception:
            pass


@magics_class
class MLXCacheMagics(Magics):
    """Magics over one Engine, created on first use from the ``MLXCache`` settings."""

    def __init__(self, shell=None, settings: MLXCache | None = None, **kwargs):
        super().__init__(shell, **kwargs)
        self.settings = settings if settings is not None else MLXCache(parent=shell)
        self._engine = None
        self._widgets: list = []
        self.last: Generation | None = None

    # --- engine ---

    @property
    def engine_started(self) -> bool:
        return self._engine is not None

    @property
    def engine(self):
        if self._engine is None:
            try:
                kwargs = self.settings.engine_kwargs()
            except ValueError as e:
                raise UsageError(f"bad mlxcache setting: {e}") from None
            from mlxcache_kernel.engine import Engine

            self._engine = Engine(**kwargs)
        return self._engine

    def _ensure_model(self, name: str | None) -> None:
        """Load the configured default model on first use when nothing is loaded."""
        eng = self.engine
        if name is not None or eng.models.default is not None:
            return
        spec = self.settings.default_model_spec()
        if spec is None:
            raise UsageError("no model is loaded: use %model load PATH (or set MLXCACHE_DEFAULT_MODEL)")
        print(f"[mlxcache] loading the default model ({spec}) ...", flush=True)
        self._load(spec, "default")

    def _load(self, spec: str, name: str) -> dict:
        t0 = time.perf_counter()
        info = self.engine.load_model(resolve_model_spec(spec), name=name)
        info["load_s"] = time.perf_counter() - t0
        return info

    def poll(self) -> None:
        """Apply finished background writes (called between cells, main thread)."""
        if self._engine is not None and not getattr(self._engine, "_closed", False):
            try:
                self._engine.poll()
            except Exception:
                pass

    def flush(self, timeout: float | None = None) -> dict | None:
        if self._engine is None or getattr(self._engine, "_closed", False):
            return None
        return self._engine.flush(timeout=timeout)

    def close(self, timeout: float | None = None) -> dict | None:
        """Close widgets, flush, close the engine (extension unload, interpreter exit)."""
        for w in self._widgets:
            try:
                w.close()
            except Exception:
                pass
        self._widgets.clear()
        if self._engine is None or getattr(self._engine, "_closed", False):
            return None
        report = self._engine.flush(timeout=timeout)
        if not report.get("pending"):
            self._engine.close()  # nothing left to wait for: returns at once
        return report

    # --- %model ---

    @magic_arguments()
    @argument("action", choices=["load", "list", "use", "unload", "info"], help="what to do")
    @argument("target", nargs="?", help="load: a model directory, hub id or 'smollm2' (default: the configured "
                                        "default model); use/unload/info: a name")
    @argument("--name", "-n", default=None, help="load: the name to register the model under (default: 'default')")
    @line_magic
    @_usage_errors
    def model(self, line):
        """Load, list, select and unload resident models.

        %model load [PATH] [--name N] load a model directory or hub id ('smollm2' = the bundled
                                      SmolLM2-135M-Instruct; no PATH = the configured default model)
        %model list                   resident models (* marks the default)
        %model use N                  make N the default for %%generate
        %model unload N               drop a model from memory
        %model info [N]               identity and shape of a model
        """
        args = _parse(self.model, line)
        eng = self.engine
        if args.name and args.action != "load":
            raise UsageError(f"--name only applies to %model load, not %model {args.action}")
        if args.action == "list":
            self._no_target(args.target, "model list")
            rows = []
            for name in eng.models.names():
                info = eng.model_info(name)
                rows.append({
                    "": "*" if name == eng.models.default else "",
                    "name": name,
                    "layers": info.get("layers"),
                    "kv": info.get("kv_scheme"),
                    "weights": format_bytes(info.get("parameters_bytes")),
                    "namespace": info.get("namespace"),
                    "path": info.get("path"),
                })
            _show_table(rows, ["", "name", "layers", "kv", "weights", "namespace", "path"],
                        empty="no models loaded (use %model load PATH)")
            return None
        if args.action == "load":
            target = args.target or self.settings.default_model_spec()
            if not target:
                raise UsageError("%model load needs a path: %model load PATH [--name N] "
                                 "(no default model is configured: MLXCACHE_DEFAULT_MODEL=none)")
            name = args.name or "default"
            info = self._load(target, name)
            star = " (default)" if eng.models.default == name else ""
            print(f"loaded {name!r}{star}: {info.get('path')} · {info.get('layers')} layers · "
                  f"{info.get('kv_scheme')} · {format_bytes(info.get('parameters_bytes'))} in {_fmt_s(info['load_s'])}")
            return None
        if args.action == "info":
            info = eng.model_info(args.target)
            for k, v in info.items():
                if isinstance(v, dict):
                    for k2, v2 in v.items():
                        print(f"{k}.{k2}: {v2}")
                else:
                    print(f"{k}: {format_bytes(v) if k.endswith('_bytes') else v}")
            return None
        if not args.target:
            raise UsageError(f"%model {args.action} needs a model name; loaded: {', '.join(eng.models.names()) or 'none'}")
        if args.action == "use":
            eng.models.use(args.target)
            print(f"default model: {args.target!r}")
        else:
            eng.unload_model(args.target)
            print(f"unloaded {args.target!r}" + (f"; default is now {eng.models.default!r}" if eng.models.default else ""))
        return None

    @staticmethod
    def _no_target(target, action: str) -> None:
        if target:
            raise UsageError(f"%{action} takes no name, got {target!r}")

    # --- %%generate ---

    @magic_arguments()
    @argument("--model", "-m", default=None, help="model name (default: the current default model)")
    @argument("--max-tokens", "-n", type=int, default=256, help="most tokens to generate (default 256)")
    @argument("--temperature", "-t", type=float, default=0.0, help="sampling temperature; 0 = greedy (default)")
    @argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1)")
    @argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = all (default)")
    @argument("--seed", "-s", type=int, default=0, help="sampling seed; same seed, same text (default 0)")
    @argument("--stop", action="append", default=[], help="stop string (repeatable)")
    @argument("--session", default=None, help="chat session id: the cell is the next user turn")
    @argument("--system", default=None, help="system prompt")
    @argument("--raw", action="store_true", help="send the cell as is, without the chat template")
    @argument("--out", "-o", default=None, help="store the result (.text, .tokens, .stats) in this variable")
    @argument("--checkpoint-every", type=int, default=None,
              help="commit an in-flight checkpoint every N generated tokens, so an identical request "
                   "after a crash, kill or interrupt resumes from it")
    @argument("--no-cache", action="store_true", help="neither look up nor publish prompt caches")
    @argument("--literal", action="store_true", help="no {name} interpolation")
    @cell_magic
    @_usage_errors
    def generate(self, line, cell):
        """Generate text from the prompt in the cell body; tokens stream into the output.

        {name} in the cell is replaced by the value of `name` in the notebook
        namespace when it is bound (other braces stay as written; {{name}}
        writes a literal {name}). The footer tells how many prompt tokens came
        from RAM, from SSD or were prefilled, the time to first token and the
        decode speed. Returns (and with --out stores) the result: .text,
        .tokens, .stats.
        """
        args = _parse(self.generate, line)
        if args.out is not None and not args.out.isidentifier():
            raise UsageError(f"--out needs a variable name, got {args.out!r}")
        if args.checkpoint_every is not None and args.checkpoint_every < 1:
            raise UsageError(f"--checkpoint-every must be >= 1, got {args.checkpoint_every}")
        if args.checkpoint_every is not None and args.no_cache:
            raise UsageError("--checkpoint-every needs the cache; drop --no-cache")
        if not cell or not cell.strip():
            raise UsageError("empty prompt: write the prompt in the cell body below %%generate")
        prompt = cell.strip("\n")
        if not args.literal:
            prompt = interpolate(prompt, self.shell.user_ns, set(getattr(self.shell, "user_ns_hidden", {})))
        if not prompt.strip():
            raise UsageError("empty prompt after interpolation")
        self._ensure_model(args.model)
        eng = self.engine
        model_name = args.model or eng.models.default
        eng.models.get(model_name)  # unknown model -> one line, before any output
        kwargs = dict(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=args.seed,
            session=args.session,
            model=model_name,
            top_p=args.top_p,
            top_k=args.top_k,
            stop=tuple(args.stop),
            system=args.system,
            raw=args.raw,
            use_cache=not args.no_cache,
        )
        if args.checkpoint_every is not None:
            if "checkpoint_every" not in inspect.signature(eng.generate).parameters:
                raise UsageError("this engine does not support --checkpoint-every yet")
            kwargs["checkpoint_every"] = args.checkpoint_every
        progress, stream = _Progress(enabled=_in_kernel(self.shell)), _Stream()
        try:
            result = eng.generate(prompt, on_text=stream, on_progress=progress, **kwargs)
        except KeyboardInterrupt:
            progress.close()
            stream.end()
            print("[mlxcache] interrupted; the cache is intact"
                  + (" and the newest in-flight checkpoint is kept" if args.checkpoint_every else ""),
                  file=sys.stderr)
            raise
        except BaseException:
            progress.close()
            stream.end()
            raise
        progress.close()
        stream.end()
        gen = Generation(result, prompt=prompt, model=model_name, session=args.session, use_cache=not args.no_cache)
        self.last = gen
        if args.out:
            self.shell.user_ns[args.out] = gen
        return gen

    # --- %session ---

    @magic_arguments()
    @argument("action", choices=["new", "list", "show", "reset", "close"], help="what to do")
    @argument("id", nargs="?", help="session id (letters, digits, '.', '_', '-')")
    @argument("--system", default=None, help="new: the session's system prompt")
    @argument("--model", "-m", default=None, help="new: the session's model")
    @line_magic
    @_usage_errors
    def session(self, line):
        """Multi-turn chat sessions for %%generate --session ID.

        %session new ID [--system TEXT] [--model N]
        %session list
        %session show ID      the conversation so far
        %session reset ID     forget the turns (the cached states stay until evicted)
        %session close ID     drop the session and its cache references (cached state is not deleted)
        """
        args = _parse(self.session, line)
        eng = self.engine
        if args.action != "new" and (args.system is not None or args.model is not None):
            raise UsageError(f"--system/--model only apply to %session new, not %session {args.action}")
        if args.action == "list":
            self._no_target(args.id, "session list")
            rows = [s.summary() for s in eng.sessions.list()]
            _show_table(rows, ["id", "model", "turns", "last_prompt_tokens", "system"],
                        empty="no sessions (use %session new ID, or %%generate --session ID)")
            return None
        if not args.id:
            raise UsageError(f"%session {args.action} needs a session id")
        if args.action == "new":
            if args.model is not None:
                eng.models.get(args.model)
            s = eng.sessions.new(args.id, system=args.system, model=args.model)
            print(f"session {s.id!r} created" + (f" (system: {args.system!r})" if args.system else ""))
        elif args.action == "show":
            s = eng.sessions.get(args.id)
            print(f"session {s.id!r}: {s.turns} turns, model {s.model or '(default)'}, "
                  f"last prompt {s.last_prompt_tokens} tokens")
            if s.system:
                print(f"[system] {s.system}")
            for msg in s.messages:
                print(f"[{msg['role']}] {msg['content']}")
        elif args.action == "reset":
            eng.sessions.reset(args.id)
            print(f"session {args.id!r} reset")
        else:
            eng.close_session(args.id)
            print(f"session {args.id!r} closed (its cached states stay until the budget evicts them)")
        return None

    # --- %checkpoint ---

    @magic_arguments()
    @argument("action", choices=["save", "list", "restore", "rm"], help="what to do")
    @argument("name", nargs="?", help="checkpoint name")
    @argument("--session", default=None, help="save: the session whose latest state to save "
                                              "(default: the last generation)")
    @argument("--model", "-m", default=None, help="save: the model (default: the current default)")
    @line_magic
    @_usage_errors
    def checkpoint(self, line):
        """Named, durable checkpoints that the cache budgets never evict.

        %checkpoint save NAME [--session ID]
        %checkpoint list
        %checkpoint restore NAME
        %checkpoint rm NAME
        """
        args = _parse(self.checkpoint, line)
        eng = self.engine
        if args.action != "save" and (args.session is not None or args.model is not None):
            raise UsageError(f"--session/--model only apply to %checkpoint save, not %checkpoint {args.action}")
        if args.action == "list":
            self._no_target(args.name, "checkpoint list")
            rows = []
            for c in eng.checkpoint_list():
                row = dict(c)
                for k in list(row):
                    if k.endswith("bytes"):
                        row[k] = format_bytes(row[k])
                    elif k in ("created", "saved", "last_used") and isinstance(row[k], (int, float)):
                        row[k] = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row[k]))
                rows.append(row)
            cols = list(dict.fromkeys(k for r in rows for k in r)) if rows else []
            _show_table(rows, cols, empty="no named checkpoints (use %checkpoint save NAME)")
            return None
        if not args.name:
            raise UsageError(f"%checkpoint {args.action} needs a name")
        if args.action == "save":
            info = eng.checkpoint_save(args.name, session=args.session, model=args.model)
            print(f"checkpoint {args.name!r} saved{self._describe(info)}")
        elif args.action == "restore":
            info = eng.checkpoint_restore(args.name)
            print(f"checkpoint {args.name!r} restored{self._describe(info)}")
        else:
            eng.checkpoint_remove(args.name)
            print(f"checkpoint {args.name!r} removed")
        return None

    @staticmethod
    def _describe(info) -> str:
        if not isinstance(info, dict):
            return ""
        bits = []
        if info.get("tokens") is not None:
            bits.append(f"{info['tokens']} tokens")
        if info.get("bytes") is not None:
            bits.append(format_bytes(info["bytes"]))
        if info.get("session"):
            bits.append(f"session {info['session']!r}")
        return f" ({', '.join(bits)})" if bits else ""

    # --- %cache ---

    @magic_arguments()
    @argument("action", choices=["stats", "ls", "flush", "clear", "gc", "verify", "config"], help="what to do")
    @argument("--ssd", action="store_true", help="clear: also delete the SSD tier's files")
    @argument("--timeout", type=float, default=None, help="flush: seconds to wait at most")
    @line_magic
    @_usage_errors
    def cache(self, line):
        """The tiered prompt cache.

        %cache stats            counters, RAM/SSD usage, pending writes
        %cache ls               every RAM and SSD entry
        %cache flush [--timeout S]   wait until every queued write is durable
        %cache clear [--ssd]    drop RAM entries (and with --ssd the SSD files)
        %cache gc               remove stale temporary and orphaned files
        %cache verify           re-hash every SSD file and report bad ones
        %cache config           the settings in effect
        """
        args = _parse(self.cache, line)
        if args.ssd and args.action != "clear":
            raise UsageError("--ssd only applies to %cache clear")
        if args.timeout is not None and args.action != "flush":
            raise UsageError("--timeout only applies to %cache flush")
        if args.action == "config":
            for k, v in self.settings.summary().items():
                print(f"{k}: {format_bytes(v) if k.endswith('_bytes') and isinstance(v, int) else v}")
            return None
        eng = self.engine
        if args.action == "stats":
            stats = eng.stats()
            width = max(len(k) for k in stats)
            for k, v in stats.items():
                if isinstance(v, bool) or v is None:
                    shown = v
                elif k.endswith("_bytes") or k == "bytes_written":
                    shown = f"{format_bytes(v)} ({v})"
                elif isinstance(v, float):
                    shown = f"{v:.3f}"
                else:
                    shown = v
                print(f"{k.ljust(width)}  {shown}")
        elif args.action == "ls":
            rows = []
            for e in eng.cache_entries():
                row = dict(e)
                row["bytes"] = format_bytes(row.get("bytes"))
                for k in ("sessions", "pinned"):
                    if isinstance(row.get(k), (list, tuple)):
                        row[k] = ",".join(map(str, row[k]))
                if isinstance(row.get("last_used"), (int, float)):
                    row["last_used"] = time.strftime("%H:%M:%S", time.localtime(row["last_used"]))
                if isinstance(row.get("preview"), str):
                    row["preview"] = row["preview"].replace("\n", "⏎")[:60]
                rows.append(row)
            cols = ["model", "tokens", "tier", "write_state", "bytes", "borrowers", "sessions", "pinned",
                    "hits", "last_used", "preview"]
            _show_table(rows, cols, empty="the cache is empty")
        elif args.action == "flush":
            r = eng.flush(timeout=args.timeout)
            failed = r.get("failed") or []
            print(f"flushed: {r.get('committed', 0)} writes committed, {r.get('pending', 0)} pending, "
                  f"{len(failed)} failed in {_fmt_s(r.get('seconds'))}")
            for f in failed:
                print(f"  failed: {f}")
        elif args.action == "clear":
            r = eng.cache_clear(ssd=args.ssd)
            print(f"cleared {r['ram_entries']} RAM entries"
                  + (f" and {r['ssd_files']} SSD files (named checkpoints kept)" if args.ssd
                     else " (SSD files kept)"))
            if r["kept_not_durable"]:
                print(f"kept {r['kept_not_durable']} entries in RAM: their SSD writes have not succeeded "
                      "(see %cache flush)")
        elif args.action == "gc":
            r = eng.cache_gc()
            if isinstance(r, dict) and r:
                shown = []
                for k, v in r.items():
                    if isinstance(v, (list, tuple)):
                        v = ", ".join(map(str, v)) if v else "none"
                    elif k.endswith("bytes"):
                        v = format_bytes(v)
                    shown.append(f"{k.replace('_', ' ')}: {v}")
                print("gc: " + "; ".join(shown))
            else:
                print("gc: nothing to do")
        else:
            t0 = time.perf_counter()
            bad = eng.cache_verify()
            stats = eng.stats()
            if not bad:
                print(f"verify: all {stats.get('ssd_files', '?')} SSD files are intact ({_fmt_s(time.perf_counter() - t0)})")
            else:
                print(f"verify: {len(bad)} bad file(s), quarantined:")
                for b in bad:
                    if isinstance(b, dict):
                        print(f"  {b.get('path')}: {b.get('reason') or b.get('error')}")
                    else:
                        print(f"  {b}")
        return None

    # --- %kv ---

    @magic_arguments()
    @argument("action", choices=["inspect", "export"], help="what to do")
    @argument("--session", default=None, help="the session's latest checkpoint")
    @argument("--checkpoint", default=None, help="a named checkpoint")
    @argument("--last", action="store_true", help="the last generation's state (the default)")
    @argument("--layer", type=int, default=None, help="only this layer")
    @argument("--to", default=None, help="export: the variable to receive {name: numpy array}")
    @argument("--widget", action="store_true", help="inspect: open the interactive KV inspector")
    @line_magic
    @_usage_errors
    def kv(self, line):
        """Look inside cached KV state.

        %kv inspect [--session ID | --checkpoint NAME | --last] [--layer L] [--widget]
        %kv export  [--session ID | --checkpoint NAME | --last] [--layer L] --to VAR
        """
        args = _parse(self.kv, line)
        chosen = [x for x in (args.session is not None, args.checkpoint is not None, args.last) if x]
        if len(chosen) > 1:
            raise UsageError("choose one of --session, --checkpoint and --last")
        if args.layer is not None and args.layer < 0:
            raise UsageError(f"--layer must be >= 0, got {args.layer}")
        if args.action == "export" and args.widget:
            raise UsageError("--widget only applies to %kv inspect")
        if args.action == "inspect" and args.to:
            raise UsageError("--to only applies to %kv export")
        eng = self.engine
        which = dict(session=args.session, checkpoint=args.checkpoint, last=not (args.session or args.checkpoint),
                     layer=args.layer)
        if args.action == "inspect":
            if args.widget:
                from mlxcache_kernel.widgets import KVInspector

                w = KVInspector(eng)
                self._widgets.append(w)
                display(w)
                return None
            rows = []
            for r in eng.kv_info(**which):
                row = dict(r)
                for k, v in list(row.items()):
                    if isinstance(v, float):
                        row[k] = f"{v:.4g}"
                    elif k == "bytes":
                        row[k] = format_bytes(v)
                    elif isinstance(v, (list, tuple)) and all(isinstance(x, int) for x in v):
                        row[k] = "x".join(map(str, v))
                    elif isinstance(v, (list, tuple)):
                        row[k] = " ".join("x".join(map(str, x)) if isinstance(x, (list, tuple)) else str(x) for x in v)
                rows.append(row)
            cols = list(dict.fromkeys(k for r in rows for k in r))
            _show_table(rows, cols, empty="no KV state")
            return None
        if not args.to:
            raise UsageError("%kv export needs --to VAR")
        if not args.to.isidentifier():
            raise UsageError(f"--to needs a variable name, got {args.to!r}")
        arrays = eng.kv_export(**which)
        self.shell.user_ns[args.to] = arrays
        total = sum(int(getattr(a, "nbytes", 0)) for a in arrays.values())
        print(f"{args.to} = {{{len(arrays)} arrays}} ({format_bytes(total)})")
        return None

    # --- %dashboard ---

    @line_magic
    @_usage_errors
    def dashboard(self, line):
        """Show the live residency dashboard (RAM/SSD entries, writes, hits)."""
        if line.strip():
            raise UsageError(f"%dashboard takes no arguments, got {line.strip()!r}")
        try:
            from mlxcache_kernel.widgets import ResidencyDashboard
        except ImportError as e:
            raise UsageError(f"the dashboard needs ipywidgets: {e}") from None
        w = ResidencyDashboard(self.engine)
        self._widgets.append(w)
        display(w)
        return None


def _in_kernel(shell) -> bool:
    return getattr(shell, "kernel", None) is not None
