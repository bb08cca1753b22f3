"""``%%score``: the cell is a context, a list variable holds the continuations to weigh; the
table ranks them by log-likelihood (`Engine.score`: the context prefilled once, every
continuation in one batch over it)."""

from __future__ import annotations

import keyword

from IPython.core.error import UsageError
from IPython.core.magic import cell_magic, magics_class
from IPython.core.magic_arguments import argument, kwds, magic_arguments

from mlxcache_kernel.engine.generate.window import max_chars

from .base import EngineMagics, parse_args, usage_errors
from .footer import SPANS
from .help import examples
from .prompt import interpolate, warn_undefined
from .output import Progress
from .tables import fmt_s, show_table


@magics_class
class ScoreMagics(EngineMagics):
    @magic_arguments()
    @kwds(epilog=examples("score"))
    @argument("options", help="a variable holding the continuations: a list of strings")
    @argument("--model", "-m", default=None, help="model name (default: the current default model)")
    @argument("--chat", action="store_true", help="the cell is a chat turn; each option the assistant's reply")
    @argument("--system", default=None, help="system prompt (with --chat)")
    @argument("--out", "-o", default=None, help="store the ranked results in this variable")
    @argument("--no-cache", action="store_true", help="neither look up nor publish the context's cache")
    @argument("--literal", action="store_true", help="no {name} interpolation")
    @argument("--truncate", choices=("left", "middle"), default=None,
              help="a context too long for the model's window is refused: left drops its oldest tokens, middle "
                   "keeps its start and end (also a {var} too long for the window: cut the same way)")
    @cell_magic
    @usage_errors
    def score(self, line, cell):
        """Rank continuations of the context in the cell by their log-likelihood given it.

        The options variable holds strings; each is scored as lm-eval's loglikelihood scores it
        (its tokens after the context's, conditioned on the context). The table shows each
        option's total and per-token log-probability and whether greedy decoding would have
        produced it; --out keeps the results, best first.
        """
        args = parse_args(self.score, line)
        if args.out is not None and (not args.out.isidentifier() or keyword.iskeyword(args.out)):
            raise UsageError(f"--out needs a variable name, got {args.out!r}")
        if args.system is not None and not args.chat:
            raise UsageError("--system applies with --chat")
        options = self.shell.user_ns.get(args.options)
        if args.options not in self.shell.user_ns:
            raise UsageError(f"{args.options!r} is not defined: give a variable holding a list of strings")
        if isinstance(options, str) or not isinstance(options, (list, tuple)) or not options \
                or not all(isinstance(o, str) for o in options):
            raise UsageError(f"{args.options!r} must hold a non-empty list of strings")
        if not cell or not cell.strip():
            raise UsageError("empty context: write it in the cell body below %%score")
        context = cell.strip("\n")
        self._ensure_model(args.model)
        if not args.literal:
            undefined: list[str] = []
            context = interpolate(context, self.shell.user_ns, set(getattr(self.shell, "user_ns_hidden", {})),
                                  undefined, limit=max_chars(self.engine.models.get(args.model)),
                                  truncate=args.truncate)
            if undefined:
                warn_undefined(undefined)
        eng = self.engine
        why = None if args.no_cache else eng.admin.why(context, model=args.model, raw=not args.chat, system=args.system)
        progress = Progress(enabled=getattr(self.shell, "kernel", None) is not None)
        try:
            results = eng.score(context, list(options), model=args.model, raw=not args.chat, system=args.system,
                                use_cache=not args.no_cache, on_progress=progress, truncate=args.truncate)
        finally:
            progress.close()
        ranked = sorted(results, key=lambda r: -r.logprob)
        show_table([{"rank": i + 1, "option": r.continuation, "logprob": f"{r.logprob:.3f}",
                     "per_token": f"{r.mean_logprob:.3f}", "tokens": len(r.tokens), "greedy": "yes" if r.greedy else "no"}
                    for i, r in enumerate(ranked)], ["rank", "option", "logprob", "per_token", "tokens", "greedy"])
        s = results[0].stats
        tier = {key: name for key, name, _ in SPANS}.get(s["source"], "the cache")
        print(f"[mlxcache] {len(results)} options over {s['context_tokens']} context tokens: "
              + (f"{s['cached_tokens']} from {tier}, " if s["cached_tokens"] else "")
              + f"{s['prefilled_tokens']} prefilled once · {fmt_s(s.get('seconds'))}")
        if why is not None and why.surprising:
            print(f"[mlxcache] why: {why.line}" + ("" if args.chat else " (--chat scores inside the chat template)"))
        if args.out:
            self.shell.user_ns[args.out] = ranked
