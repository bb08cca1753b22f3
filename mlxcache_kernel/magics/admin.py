"""The magics that manage rather than generate: ``%model``, ``%session``,
``%checkpoint``, ``%kv`` and ``%dashboard`` (``%cache`` is cache.py's).

Each parses its options, asks the Engine, and prints a line or shows a table
(``tables.py``). Bad options and unknown names end in one UsageError line.
"""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import line_magic, magics_class
from IPython.core.magic_arguments import argument, kwds, magic_arguments

from mlxcache_kernel.engine.cache.why import kv_words
from mlxcache_kernel.engine.chat.sessions import shown_message

from .base import EngineMagics, no_target, only_for, parse_args, usage_errors
from .help import examples
from .tables import checkpoint_row, columns_of, describe_checkpoint, fmt_s, format_bytes, kv_row, show_table

__all__ = ["AdminMagics"]


@magics_class
class AdminMagics(EngineMagics):
    """Models, sessions, named checkpoints, KV inspection and the dashboard."""

    # --- %model ---

    @magic_arguments()
    @kwds(epilog=examples("model"))
    @argument("action", choices=["load", "list", "use", "unload", "info"], help="what to do")
    @argument("target", nargs="?", help="load: a model directory, hub id or 'smollm2' (default: the configured "
                                        "default model); use/unload/info: a name")
    @argument("--name", "-n", default=None, help="load: the name to register the model under (default: 'default')")
    @argument("--kv-bits", type=int, choices=[4, 8], default=None, help="load: quantize the KV cache to 4 or 8 bits")
    @argument("--kv-start", type=int, default=None, help="load: with --kv-bits, N first tokens unquantized (5000)")
    @argument("--kv-group-size", type=int, choices=[32, 64, 128], default=64, help="load: values per quantization group")
    @argument("--adapter", default=None, help="load: an mlx-lm LoRA adapter directory (a cache of its own)")
    @argument("--draft", default=None, metavar="NAME", help="load: the loaded model NAME is this model's default draft")
    @argument("--image-attention", choices=["bidirectional", "causal"], default=None,
              help="load, a vision-language model: how image tokens attend (default: the model's own)")
    @argument("--chat-template", default=None, metavar="FILE", help="load: render chats with this template (a .jinja "
              "file or a tokenizer_config.json) instead of the model's own, as mlx-lm's --chat-template")
    @line_magic
    @usage_errors
    def model(self, line):
        """Load, list, select and unload resident models.

        %model load [PATH] [--name N] load a model directory or hub id ('smollm2' = the bundled
                                      SmolLM2-135M-Instruct; no PATH = the configured default model)
                 [--kv-bits 8 [--kv-start N]]  KV quantized to 4|8 bits from token N (default 5000)
                 [--adapter DIR]      with an mlx-lm LoRA adapter (adapters.safetensors + adapter_config.json)
                 [--draft NAME]       loaded model NAME drafts for it (%%generate --no-draft: not)
                 [--chat-template F]  another chat template than the model's own
        %model list                   resident models (* marks the default)
        %model use N                  make N the default for %%generate
        %model unload N               drop a model from memory
        %model info [N]               identity and shape of a model
        """
        args = parse_args(self.model, line)
        eng = self.engine
        if args.action != "load" and (args.name or args.kv_bits or args.kv_start is not None or args.adapter
                                      or args.draft or args.chat_template):
            raise UsageError(f"--name, --kv-bits, --kv-start, --adapter, --draft and --chat-template only apply to "
                             f"%model load, not %model {args.action}")
        if args.action == "list":
            no_target(args.target, "model list")
            self._model_list()
        elif args.action == "load":
            extra = {k: v for k, v in (("image_attention", args.image_attention), ("kv_start", args.kv_start),
                                       ("draft", args.draft), ("chat_template", args.chat_template)) if v is not None}
            self._model_load(args.target, args.name or "default", kv_bits=args.kv_bits,
                             kv_group_size=args.kv_group_size, adapter_path=args.adapter, **extra)
        elif args.action == "info":
            for k, v in eng.models.info(args.target).items():
                if isinstance(v, dict):
                    for k2, v2 in v.items():
                        print(f"{k}.{k2}: {v2}")
                else:
                    print(f"{k}: {format_bytes(v) if k.endswith('_bytes') else v}")
        elif not args.target:
            raise UsageError(f"%model {args.action} needs a model name; loaded: {', '.join(eng.models.names()) or 'none'}")
        elif args.action == "use":
            eng.models.use(args.target)
            print(f"default model: {args.target!r}")
        else:
            eng.models.unload(args.target)
            print(f"unloaded {args.target!r}" + (f"; default is now {eng.models.default!r}" if eng.models.default else ""))
        return None

    def _model_list(self) -> None:
        eng = self.engine
        rows = []
        for name in eng.models.names():
            info = eng.models.info(name)
            rows.append({
                "": "*" if name == eng.models.default else "",
                "name": name,
                "layers": info.get("layers"),
                "kv": info.get("kv_scheme"),
                "adapter": info.get("adapter") or "-",
                "weights": format_bytes(info.get("parameters_bytes")),
                "namespace": info.get("namespace"),
                "path": info.get("path"),
            })
        show_table(rows, ["", "name", "layers", "kv", "adapter", "weights", "namespace", "path"],
                   empty="no models loaded (use %model load PATH)")

    def _model_load(self, target: str | None, name: str, **kv) -> None:
        target = target or self.settings.default_model_spec()
        if not target:
            raise UsageError("%model load needs a path: %model load PATH [--name N] "
                             "(no default model is configured: MLXCACHE_DEFAULT_MODEL=none)")
        info = self._load(target, name, **kv)
        star = " (default)" if self.engine.models.default == name else ""
        adapter = f" + adapter {info['adapter']}" if info.get("adapter") else ""
        adapter += f" · chat template {info['chat_template']}" if info.get("chat_template") else ""
        print(f"loaded {name!r}{star}: {info.get('path')}{adapter} · {info.get('layers')} layers · "
              f"{info.get('kv_scheme')} ({kv_words(info.get('kv_scheme'))}) · {format_bytes(info.get('parameters_bytes'))} "
              f"in {fmt_s(info['load_s'])}")
        if info.get("cache_notice"):
            print(f"note: {info['cache_notice']}")
        prefetch = info.get("prefetch") or {}
        if prefetch.get("checkpoints"):
            n = prefetch["checkpoints"]
            print(f"loading {n} recently used cached prompt{'s' if n != 1 else ''} ({format_bytes(prefetch['bytes'])}) "
                  "from SSD in the background")
        if prefetch.get("note"):
            print(f"note: {prefetch['note']}")

    # --- %session ---

    @magic_arguments()
    @kwds(epilog=examples("session"))
    @argument("action", choices=["new", "list", "show", "switch", "reset", "close"], help="what to do")
    @argument("id", nargs="?", help="session id (letters, digits, '.', '_', '-')")
    @argument("--system", default=None, help="new: the session's system prompt")
    @argument("--model", "-m", default=None, help="new: the session's model")
    @line_magic
    @usage_errors
    def session(self, line):
        """Multi-turn chat sessions for %%generate --session ID.

        %session new ID [--system TEXT] [--model N]
        %session list
        %session show ID      the conversation so far
        %session switch ID    bring its cached state back into RAM (in the background from SSD)
        %session reset ID     forget the turns (the cached states stay until evicted)
        %session close ID     drop the session and its cache references (cached state is not deleted)
        """
        args = parse_args(self.session, line)
        eng = self.engine
        only_for(args, "session", "new", "system", "model")
        if args.action == "list":
            no_target(args.id, "session list")
            rows = [s.summary() for s in eng.sessions.list()]
            show_table(rows, ["id", "model", "turns", "last_prompt_tokens", "system"],
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
                print(f"[{msg['role']}] {shown_message(msg)}")
        elif args.action == "switch":
            info = eng.sessions.switch(args.id)
            state = {"ram": "its state is in RAM", "loading": "loading its state from SSD in the background",
                     None: "no cached state (the next turn prefills)"}[info["source"]]
            tokens = f" ({info['tokens']} tokens)" if info["tokens"] else ""
            print(f"session {args.id!r}: {state}{tokens}")
        elif args.action == "reset":
            eng.sessions.reset(args.id)
            print(f"session {args.id!r} reset")
        else:
            eng.sessions.close(args.id)
            print(f"session {args.id!r} closed (its cached states stay until the budget evicts them)")
        return None

    # --- %checkpoint ---

    @magic_arguments()
    @kwds(epilog=examples("checkpoint"))
    @argument("action", choices=["save", "list", "restore", "rm"], help="what to do")
    @argument("name", nargs="?", help="checkpoint name")
    @argument("--session", default=None, help="save: the session whose latest state to save "
                                              "(default: the last generation)")
    @argument("--model", "-m", default=None, help="save: the model (default: the current default)")
    @line_magic
    @usage_errors
    def checkpoint(self, line):
        """Named, durable checkpoints that the cache budgets never evict.

        %checkpoint save NAME [--session ID]
        %checkpoint list
        %checkpoint restore NAME
        %checkpoint rm NAME
        """
        args = parse_args(self.checkpoint, line)
        eng = self.engine
        only_for(args, "checkpoint", "save", "session", "model")
        if args.action == "list":
            no_target(args.name, "checkpoint list")
            rows = [checkpoint_row(c) for c in eng.checkpoints.list()]
            show_table(rows, columns_of(rows), empty="no named checkpoints (use %checkpoint save NAME)")
            return None
        if not args.name:
            raise UsageError(f"%checkpoint {args.action} needs a name")
        if args.action == "rm":
            eng.checkpoints.remove(args.name)
            print(f"checkpoint {args.name!r} removed")
            return None
        if args.action == "save":
            info = eng.checkpoints.save(args.name, session=args.session, model=args.model)
        else:
            info = eng.checkpoints.restore(args.name)
        done = "saved" if args.action == "save" else "restored"
        if info.get("source") == "loading":
            done = "loading from SSD in the background"
        print(f"checkpoint {args.name!r} {done}{describe_checkpoint(info)}")
        return None

    # --- %kv ---

    @magic_arguments()
    @kwds(epilog=examples("kv"))
    @argument("action", choices=["inspect", "export"], help="what to do")
    @argument("--session", default=None, help="the session's latest checkpoint")
    @argument("--checkpoint", default=None, help="a named checkpoint")
    @argument("--last", action="store_true", help="the last generation's state (the default)")
    @argument("--layer", type=int, default=None, help="only this layer")
    @argument("--to", default=None, help="export: the variable to receive {name: numpy array}")
    @argument("--widget", action="store_true", help="inspect: open the interactive KV inspector")
    @line_magic
    @usage_errors
    def kv(self, line):
        """Look inside cached KV state.

        %kv inspect [--session ID | --checkpoint NAME | --last] [--layer L] [--widget]
        %kv export  [--session ID | --checkpoint NAME | --last] [--layer L] --to VAR
        """
        args = parse_args(self.kv, line)
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
        if args.action == "inspect" and args.widget:
            from mlxcache_kernel.widgets import KVInspector

            self._show_widget(KVInspector(eng))
        elif args.action == "inspect":
            rows = [kv_row(r) for r in eng.kv.info(**which)]
            show_table(rows, columns_of(rows), empty="no KV state")
        else:
            self._kv_export(which, args.to)
        return None

    def _kv_export(self, which: dict, to: str | None) -> None:
        if not to:
            raise UsageError("%kv export needs --to VAR")
        if not to.isidentifier():
            raise UsageError(f"--to needs a variable name, got {to!r}")
        arrays = self.engine.kv.export(**which)
        self.shell.user_ns[to] = arrays
        total = sum(int(getattr(a, "nbytes", 0)) for a in arrays.values())
        print(f"{to} = {{{len(arrays)} arrays}} ({format_bytes(total)})")

    # --- %dashboard ---

    @line_magic
    @usage_errors
    def dashboard(self, line):
        """Show the live residency dashboard (RAM/SSD entries, writes, hits)."""
        if line.strip():
            raise UsageError(f"%dashboard takes no arguments, got {line.strip()!r}")
        try:
            from mlxcache_kernel.widgets import ResidencyDashboard
            from mlxcache_kernel.widgets.dashboard_render import GONE_NOTE
        except ImportError as e:
            raise UsageError(f"the dashboard needs ipywidgets: {e}") from None
        from IPython.display import display

        self._show_widget(ResidencyDashboard(self.engine))
        display({"text/plain": "", "text/html": GONE_NOTE}, raw=True)  # seen once the widget's view is gone
        return None
