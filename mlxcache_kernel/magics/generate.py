"""``%%generate``: prompt interpolation (and the warning for undefined names),
the generation itself, its streamed output and progress display. The result
and its footer are ``footer.py``'s.

Prompt interpolation: ``{name}`` is replaced by ``str(value)`` when ``name``
is a plain identifier bound in the user namespace to a value (not a module,
function or class, and not one of IPython's hidden names such as
``In``/``Out``). Every other brace stays as written, so documents, JSON and
code can be pasted as they are; the cell is never ``str.format``-ed.
``{{name}}`` writes a literal ``{name}`` (the one escape, for the rare text
that mentions a defined variable in braces); any other ``{{``/``}}`` is left
untouched. ``--literal`` turns interpolation off.

Progress of a long prefill or SSD restore is the widgets' own display
(``GenerationProgress``, or ``TextProgress`` in one output line when the
widget cannot be shown); the generated text streams to stdout.
"""

from __future__ import annotations

import keyword
import re
import sys

from IPython.core.error import UsageError
from IPython.core.magic import cell_magic, magics_class, no_var_expand
from IPython.core.magic_arguments import argument, kwds, magic_arguments

from mlxcache_kernel.engine.generate.window import max_chars

from .base import EngineMagics, parse_args, sampling_arguments, sampling_options, usage_errors
from .chat import Thinking, chat_arguments, chat_options, show_step
from .constrain import constraint_arguments, constraint_options
from .footer import CellResult
from .help import examples
from .output import Progress, Stream
from .prompt import interpolate, warn_undefined

__all__ = ["GenerateMagics"]

_IMAGE_VAR = re.compile(r"((?:^|\s)(?:--image|-i|--video|--audio)(?:\s+|=))\{([A-Za-z_][A-Za-z0-9_]*)\}")
# a pattern's and a schema's braces are theirs ([0-9]{3}, {"type": ...}): kept as written, not expanded
_VERBATIM = re.compile(r"""((?:^|\s)(?:--regex|--json)(?:\s+|=))('[^']*'|"[^"]*"|\S+)""")


def _in_kernel(shell) -> bool:
    return getattr(shell, "kernel", None) is not None


@magics_class
class GenerateMagics(EngineMagics):
    """``%%generate`` over the Engine."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.last: CellResult | None = None

    @magic_arguments()
    @kwds(epilog=examples("generate"))
    @argument("--model", "-m", default=None, help="model name (default: the current default model)")
    @sampling_arguments
    @argument("--session", default=None, help="chat session id: the cell is the next user turn")
    @argument("--system", default=None, help="system prompt")
    @argument("--raw", action="store_true", help="send the cell as is, without the chat template")
    @argument("--out", "-o", default=None, help="store the result (.text, .tokens, .stats) in this variable")
    @argument("--checkpoint-every", type=int, default=None,
              help="commit an in-flight checkpoint every N generated tokens, so an identical request "
                   "after a crash, kill or interrupt resumes from it")
    @argument("--image", "-i", action="append", default=[], metavar="PATH",
              help="an image for a vision-language model (repeatable, in order); {var} names a variable "
                   "holding a path, a PIL image or an array")
    @argument("--video", action="append", default=[], metavar="PATH",
              help="a video for Qwen2-VL / Qwen2.5-VL (repeatable, in order, after the images): a video file, a "
                   "directory of frame images, a .npy/.npz file, or {var} holding one or a (T, C, H, W) array")
    @argument("--fps", type=float, default=None, metavar="F",
              help="frames per second to sample from each --video (default: the model's processor's)")
    @argument("--max-frames", type=int, default=None, metavar="N", help="at most N frames per --video")
    @argument("--audio", action="append", default=[], metavar="PATH",
              help="a recording for Gemma 4 (repeatable, in order, after the videos): an audio file (WAV, FLAC, "
                   "MP3) or {var} holding one or a 1-D float waveform at the model's sampling rate")
    @argument("--draft", default=None, metavar="NAME",
              help="speculative decoding: the loaded model NAME proposes tokens the model verifies "
                   "(same tokens as without it)")
    @argument("--no-draft", action="store_true", help="decode without the model's default draft (%%model load --draft)")
    @argument("--draft-tokens", type=int, default=None, metavar="K",
              help="tokens the draft proposes per step (default 4; with --draft)")
    @argument("--lookup", action="store_true",
              help="drafts from the prompt and the text so far, verified by the model (same tokens), at every step "
                   "(default: where they pay)")
    @argument("--no-lookup", action="store_true", help="no drafts from the context")
    @chat_arguments
    @constraint_arguments
    @argument("--no-cache", action="store_true", help="neither look up nor publish prompt caches")
    @argument("--literal", action="store_true", help="no {name} interpolation")
    @argument("--truncate", choices=("left", "middle"), default=None,
              help="a prompt past the model's window (with --max-tokens) is refused: left drops its oldest tokens, "
                   "middle keeps its start and end (also a {var} too long for the window: cut the same way)")
    @argument("--batch", default=None, metavar="VAR",
              help="the cell is a template over the items of VAR (a list, Series or DataFrame: {item}, "
                   "{column}); the rows decode together and the result is a table")
    @argument("--n", type=int, default=None, dest="samples", metavar="K",
              help="K samples of the prompt (seeds s..s+K-1) from one prefill; with --batch, K per item")
    @argument("--passages", default=None, metavar="VAR",
              help="VAR (a list of strings, a Series or a one-column DataFrame; VAR.column too) goes before the "
                   "prompt, each passage placed from its own cached KV and partly recomputed: approximate, and the "
                   "footer says so")
    @argument("--recompute", type=float, default=None, metavar="F",
              help="with --passages: the fraction of placed passage tokens recomputed (default: the "
                   "passage_recompute setting; 1: what a full prefill computes)")
    @no_var_expand  # _expand_line: as IPython expands, but --image {var} keeps the object
    @cell_magic
    @usage_errors
    def generate(self, line, cell):
        """Generate text from the prompt in the cell body; tokens stream into the output.

        {name} in the cell is replaced by the value of `name` in the notebook
        namespace when it is bound (other braces stay as written; {{name}}
        writes a literal {name}). The footer tells how many prompt tokens came
        from RAM, from SSD or were prefilled, the time to first token and the
        decode speed. Returns (and with --out stores) the result: .text,
        .tokens, .stats (and .parsed with --json, --regex, --choice or --grammar).
        With --batch VAR or --n K, many prompts run as one batch (batch.py).
        """
        line, held = self._expand_line(line)
        args = parse_args(self.generate, line)
        args.image = [held.get(spec, spec) for spec in args.image]
        args.video = [held.get(spec, spec) for spec in args.video]
        args.audio = [held.get(spec, spec) for spec in args.audio]
        if (args.fps is not None or args.max_frames is not None) and not args.video:
            raise UsageError("--fps and --max-frames go with --video")
        if args.out is not None and (not args.out.isidentifier() or keyword.iskeyword(args.out)):
            raise UsageError(f"--out needs a variable name, got {args.out!r}")
        if args.draft is not None and (args.batch is not None or args.samples is not None):
            raise UsageError("--draft does not go with --batch or --n: batch rows decode together, without a draft")
        if args.draft_tokens is not None and args.draft is None and not _default_draft(self.engine, args.model):
            raise UsageError("--draft-tokens needs --draft NAME")
        if args.no_draft and args.draft is not None:
            raise UsageError("--draft and --no-draft contradict each other: use one")
        if args.lookup and args.no_lookup:
            raise UsageError("--lookup and --no-lookup contradict each other: use one")
        if args.recompute is not None and args.passages is None:
            raise UsageError("--recompute goes with --passages VAR")
        if args.passages is not None and (args.batch is not None or args.samples is not None):
            raise UsageError("--passages does not go with --batch or --n: one prompt at a time")
        chat = chat_options(args, self.shell.user_ns)
        if args.batch is not None or args.samples is not None:
            if chat:
                raise UsageError("--think, --template-arg and --tools go with single cells, not --batch or --n")
            from .batch import run_batch

            return run_batch(self, args, cell, in_kernel=_in_kernel(self.shell))
        if args.checkpoint_every is not None and args.checkpoint_every < 1:
            raise UsageError(f"--checkpoint-every must be >= 1, got {args.checkpoint_every}")
        if args.checkpoint_every is not None and args.logprobs is not None:
            raise UsageError("--logprobs and --checkpoint-every do not go together (a resume keeps no log-probabilities)")
        if args.checkpoint_every is not None and args.no_cache:
            raise UsageError("--checkpoint-every needs the cache; drop --no-cache")
        self._ensure_model(args.model)
        eng = self.engine
        model_name = args.model or eng.models.default
        eng.models.get(model_name)  # unknown model -> one line, before any output
        prompt = self._prompt(cell, literal=args.literal, model=model_name, truncate=args.truncate)
        kwargs = dict(sampling_options(args), session=args.session, model=model_name, system=args.system,
                      raw=args.raw, use_cache=not args.no_cache, truncate=args.truncate,
                      **constraint_options(args, self.shell.user_ns), **chat)
        if args.lookup or args.no_lookup:  # (neither: where they pay)
            kwargs["lookup"] = bool(args.lookup)
        if args.draft is not None or args.no_draft or args.draft_tokens is not None:  # None: the default draft
            kwargs.update(draft=False if args.no_draft else args.draft, num_draft_tokens=args.draft_tokens)
        if args.image:
            kwargs["images"] = [self._image(spec) for spec in args.image]
        if args.video:
            kwargs.update(videos=[self._image(spec, "--video") for spec in args.video], fps=args.fps,
                          max_frames=args.max_frames)
        if args.audio:
            kwargs["audios"] = [self._image(spec, "--audio") for spec in args.audio]
        if args.checkpoint_every is not None:
            kwargs["checkpoint_every"] = args.checkpoint_every
        if args.passages is not None:
            kwargs.update(passages=self._variable(args.passages, "--passages"), recompute=args.recompute)
        result = self._run(prompt, kwargs, resumable=args.checkpoint_every is not None)
        gen = CellResult(result, prompt=prompt, model=model_name, session=args.session, use_cache=not args.no_cache,
                         tokenizer=eng.models.get(model_name).tokenizer)
        self.last = gen
        if args.out:
            self.shell.user_ns[args.out] = gen
        return gen

    def _expand_line(self, line: str) -> tuple[str, dict]:
        """The options line with {name} and $name expanded from the notebook namespace, as
        IPython does for other magics, except `--image {name}` / `--video {name}` / `--audio {name}`: held back (placeholder ->
        "{name}") so the image is the variable's object, not its text; and --regex's and --json's values, as written."""
        from IPython.utils.text import DollarFormatter

        held: dict = {}

        def hold(m: re.Match) -> str:
            key = f"__mlxcache_image_{len(held)}__"
            held[key] = "{" + m.group(2) + "}"
            return m.group(1) + key

        verbatim: dict = {}

        def keep(m: re.Match) -> str:
            key = f"__mlxcache_verbatim_{len(verbatim)}__"
            verbatim[key] = m.group(2)
            return m.group(1) + key

        line = _VERBATIM.sub(keep, _IMAGE_VAR.sub(hold, line))
        try:
            line = DollarFormatter().vformat(line, args=[], kwargs=dict(self.shell.user_ns))
        except Exception:
            pass  # as IPython does: a line that cannot be expanded is used as written
        for key, text in verbatim.items():
            line = line.replace(key, text)
        return line, held

    def _image(self, spec: str, option: str = "--image"):
        """--image / --video / --audio: a path, or {name} of a variable holding a path, a PIL image or an array."""
        m = re.fullmatch(r"\{([A-Za-z_][A-Za-z0-9_]*)\}", spec.strip())
        if m is None:
            return spec
        if m.group(1) not in self.shell.user_ns:
            raise UsageError(f"{option} {spec}: {m.group(1)!r} is not defined")
        return self.shell.user_ns[m.group(1)]

    def _variable(self, spec: str, option: str):
        """A notebook variable by name, or an attribute of one (VAR.column)."""
        name, *attrs = spec.strip().split(".")
        if not name.isidentifier() or name not in self.shell.user_ns:
            raise UsageError(f"{option} {spec}: {name!r} is not defined")
        value = self.shell.user_ns[name]
        for attr in attrs:
            if not hasattr(value, attr):
                raise UsageError(f"{option} {spec}: {name} has no {attr!r}")
            value = getattr(value, attr)
        return value

    def _prompt(self, cell: str, *, literal: bool, model: str, truncate: str | None = None) -> str:
        """The cell body, interpolated unless ``literal`` (a {var} longer than `model`'s window could
        hold: refused, or cut as `truncate` says); never empty."""
        if not cell or not cell.strip():
            raise UsageError("empty prompt: write the prompt in the cell body below %%generate")
        prompt = cell.strip("\n")
        if not literal:
            undefined: list[str] = []
            prompt = interpolate(prompt, self.shell.user_ns, set(getattr(self.shell, "user_ns_hidden", {})), undefined,
                                 limit=max_chars(self.engine.models.get(model)), truncate=truncate)
            if undefined:
                warn_undefined(undefined)
        if not prompt.strip():
            raise UsageError("empty prompt after interpolation")
        return prompt

    def _run(self, prompt: str, kwargs: dict, *, resumable: bool):
        """Generate with streamed text and a progress display, both closed however it ends."""
        progress, stream = Progress(enabled=_in_kernel(self.shell)), Stream()
        thinking = Thinking(enabled=_in_kernel(self.shell))  # the reasoning, collapsed above the answer
        if "tools" in kwargs:
            kwargs["on_step"] = show_step
        interrupted = False
        try:
            return self.engine.generate(prompt, on_text=stream, on_progress=progress, on_reasoning=thinking, **kwargs)
        except KeyboardInterrupt:
            interrupted = True
            raise
        finally:
            progress.close()
            thinking.close()
            stream.end()
            if interrupted:
                print("[mlxcache] interrupted; the cache is intact"
                      + (" and the newest in-flight checkpoint is kept" if resumable else ""),
                      file=sys.stderr)


def _default_draft(eng, model: str | None) -> str | None:
    """The default draft (%model load --draft) of the model a cell would use, if it is loaded."""
    name = model or eng.models.default
    return eng.models.get(name).info.get("draft") if name is not None and name in eng.models else None
