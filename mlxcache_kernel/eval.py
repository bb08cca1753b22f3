"""lm-evaluation-harness over the engine: `CachedLM`, the harness's model "mlxcache".

The harness asks for log-likelihoods of (context, continuation) pairs, rolling log-likelihoods of
whole documents and generations until stop strings; `CachedLM` answers them with the engine, so
its prompt cache serves them: `loglikelihood` hands every pair to `Engine.score_groups` (a task's
few-shot block prefilled once, each question's context once for its choices, the choices batched;
a rerun, after a restart too, from RAM or SSD), `loglikelihood_rolling` scores the harness's own
windows the same way, `generate_until` runs `Engine.generate_batch` over the cache with the
request's stop strings and `max_gen_toks`.

Tokenization is the harness's (a context's trailing spaces move to the continuation; an empty
context is the prefix token, as its HFLM does; a context too long for the window is cut from the
left, keeping the continuation whole), with special tokens added as `mlx_lm.evaluate` adds them
(only when the tokenizer has no chat template) unless `add_bos_token` says otherwise.

    lm_eval.simple_evaluate(model=CachedLM(pretrained=PATH), tasks=[...])     # its own engine
    lm_eval.simple_evaluate(model=CachedLM(engine=eng, model="default"), ...)  # a notebook's engine
    mlxcache-kernel eval --model_args pretrained=PATH,kv_bits=8 --tasks ...    # the harness's CLI
"""

from __future__ import annotations

import atexit
import sys

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as e:  # the [eval] extra
    raise ImportError("mlxcache_kernel.eval needs lm-eval: pip install 'mlxcache-kernel[eval]'") from e
from tqdm.auto import tqdm

from .engine import ConfigError, Engine, GenerationError
from .engine.generate.scoring import encode_pairs

MAX_GEN_TOKS = 256  # the harness's default for a request that names none (its HFLM's)


@register_model("mlxcache")
class CachedLM(LM):
    """An lm-eval model backed by an `Engine`: `CachedLM(pretrained=PATH, ...)` (what
    `--model_args` builds; an engine of its own on `cache_dir`, by default the engine's default
    directory, shared with notebooks) or `CachedLM(engine=eng, model=NAME)` over a loaded model."""

    def __init__(self, pretrained: str | None = None, *, engine: Engine | None = None, model: str | None = None,
                 kv_bits: int | None = None, kv_group_size: int = 64, kv_start: int | None = None,
                 adapter: str | None = None, draft: str | None = None, cache_dir: str | None = None,
                 add_bos_token: bool | None = None, max_length: int | None = None, batch_size=None,
                 max_batch_size=None, device=None, seed: int = 0):
        """batch_size: rows generated together (the harness's "auto" and its default of 1: the
        engine's default); max_batch_size and device are the harness's to pass: MLX's default
        device is used whatever it names."""
        super().__init__()
        loads = {"kv_bits": kv_bits, "kv_start": kv_start, "adapter": adapter, "draft": draft, "cache_dir": cache_dir}
        if pretrained == "default":  # the engine's default model (converted once)
            from .engine.models.convert import ensure_default_model

            pretrained = str(ensure_default_model())
        if (engine is None) == (pretrained is None):
            raise ConfigError("CachedLM: give pretrained=PATH (a model to load) or engine=ENGINE (a loaded one)")
        if engine is not None and any(v is not None for v in loads.values()):
            given = ", ".join(k for k, v in loads.items() if v is not None)
            raise ConfigError(f"CachedLM: {given} apply to a model being loaded: load it so (eng.load_model) "
                              "and pass engine= and model=")
        self._owned = engine is None
        if self._owned:
            engine = Engine() if cache_dir is None else Engine(cache_dir=cache_dir)
            self.engine = engine
            atexit.register(self.close)
            try:
                draft_name = None
                if draft is not None:
                    draft_name = engine.load_model(draft, name="draft")["name"]
                engine.load_model(pretrained, name="eval", kv_bits=kv_bits, kv_group_size=kv_group_size,
                                  kv_start=kv_start, adapter_path=adapter, draft=draft_name)
            except Exception:
                self.close()
                raise
            model = "eval"
        self.engine, self.model_name = engine, engine.models.get(model).name
        self._loaded = engine.models.get(self.model_name)
        self.tokenizer = self._loaded.tokenizer
        self.add_bos_token = (getattr(self.tokenizer, "chat_template", None) is None if add_bos_token is None
                              else bool(add_bos_token))
        window = self._loaded.context_window
        self.max_length = int(max_length or window or 2048)
        self.batch_size = batch_size if isinstance(batch_size, int) and batch_size > 1 else None
        self.seed = int(seed)

    # --- what the harness reads ---

    @property
    def tokenizer_name(self) -> str:
        return str(self._loaded.path).replace("/", "__")

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context stands for (the harness's: BOS where there is one, else EOS)."""
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return bos if bos is not None else self.tokenizer.eos_token_id

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.tokenizer, "chat_template", None) if chat_template else None

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    def encode(self, text: str, special: bool | None = None) -> list[int]:
        special = self.add_bos_token if special is None else special
        return list(self.tokenizer.encode(text, add_special_tokens=special))

    # --- requests ---

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self._pair(*req.args) for req in requests]
        results = self._score(pairs, "loglikelihood", disable_tqdm)
        out = [(r.logprob, r.greedy) for r in results]
        for req, answer in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", req.args, answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood over the harness's disjoint windows of the model's length."""
        windows, owner = [], []
        for n, req in enumerate(requests):
            tokens = self.encode(req.args[0])
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1)):
                windows.append((ctx, cont))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, r in zip(owner, self._score(windows, "loglikelihood_rolling", disable_tqdm)):
            totals[n] += r.logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, with do_sample) generations, batched over the cache per set of
        generation options; each cut at the first of its stop strings."""
        eos = self.tokenizer.decode([self.tokenizer.eos_token_id])
        out = [None] * len(requests)
        groups: dict = {}
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            kwargs = normalize_gen_kwargs(dict(gen_kwargs or {}), MAX_GEN_TOKS)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            options = {"max_tokens": int(kwargs.pop("max_gen_toks")), "stop": tuple(s for s in until if s),
                       "temperature": float(kwargs.pop("temperature", 0.0)) if kwargs.pop("do_sample") else 0.0}
            for name in ("top_p", "top_k"):
                if name in kwargs:
                    options[name] = kwargs.pop(name)
            groups.setdefault(tuple(sorted(options.items())), []).append((i, self._prompt(context, options)))
        bar = tqdm(total=len(requests), desc="generate_until", disable=disable_tqdm)
        try:
            for key, rows in groups.items():
                texts = self._generate([p for _, p in rows], dict(key), bar)
                for (i, _), text in zip(rows, texts):
                    for stop in dict(key)["stop"]:
                        text = text.split(stop)[0]
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        finally:
            bar.close()
        return out

    def close(self) -> None:
        """Close an engine this model opened (its queued SSD writes made durable)."""
        if self._owned and not self.engine.closed:
            self.engine.close()

    # --- the engine's side ---

    def _pair(self, context: str, continuation: str) -> tuple[list, list]:
        """(context ids, continuation ids) as the harness tokenizes them, the context cut from the
        left to the model's length (the continuation whole)."""
        if context == "":
            cont = self.encode(continuation, special=False)
            ctx, cont = ([self.prefix_token_id], cont) if cont[:1] != [self.prefix_token_id] else (cont[:1], cont[1:])
        else:
            ctx, [cont] = encode_pairs(self.encode, context, [continuation])
        if len(cont) > self.max_length:
            raise GenerationError(f"a continuation of {len(cont)} tokens is longer than the model's length "
                                  f"({self.max_length}): the harness cannot score it either")
        keep = self.max_length + 1 - len(cont)  # the model attends over the context and all but the last
        return ctx[-keep:] if len(ctx) > keep else ctx, cont

    def _score(self, pairs: list, what: str, disable_tqdm: bool) -> list:
        bar = tqdm(total=len(pairs), desc=what, disable=disable_tqdm)
        try:
            return self.engine.score_groups(pairs, model=self.model_name,
                                            on_progress=lambda _, done, total: bar.update(done - bar.n))
        finally:
            bar.close()

    def _prompt(self, context: str, options: dict) -> list[int]:
        """The context's tokens, cut from the left to leave room for max_tokens (the harness's rule)."""
        room = self.max_length - options["max_tokens"]
        if room <= 0:
            raise GenerationError(f"max_gen_toks {options['max_tokens']} leaves no room for a context within "
                                  f"the model's length ({self.max_length})")
        tokens = self.encode(context) or [self.prefix_token_id]
        return tokens[-room:]

    def _generate(self, prompts: list, options: dict, bar) -> list[str]:
        if self._loaded.info.get("draft") is not None:  # a draft proposes for one row at a time
            results = []
            for p in prompts:
                results.append(self.engine.generate_tokens(p, model=self.model_name, seed=self.seed, **options))
                bar.update(1)
        else:
            kw = {"batch_size": self.batch_size} if self.batch_size else {}
            results = self.engine.generate_batch(prompts, model=self.model_name, seed=self.seed,
                                                 on_row=lambda *_: bar.update(1), **kw, **options)
        return [self._text(r.tokens) for r in results]

    def _text(self, tokens: list) -> str:
        """The generated tokens as text, as the harness's models decode them: the first token's
        leading space kept (a streaming detokenizer drops it), an end token left out."""
        if tokens and tokens[-1] in self._loaded.eos_token_ids:
            tokens = tokens[:-1]
        return self.tokenizer.decode(tokens)



def run_harness(argv: list[str]) -> int:
    """`mlxcache-kernel eval ARGS`: the harness's own command line (`lm-eval run ARGS`: --tasks,
    --num_fewshot, --limit, --include_path, --output_path, ...) with this model registered, --model
    mlxcache and pretrained=default unless given; an error the harness raises is one line."""
    from lm_eval.__main__ import cli_evaluate

    argv = list(argv)
    if argv[:1] == ["run"]:
        argv = argv[1:]
    if not any(a == "--model" or a.startswith("--model=") for a in argv):
        argv = ["--model", "mlxcache", *argv]
    if not any(a == "--model_args" or a.startswith("--model_args=") for a in argv):
        argv += ["--model_args", "pretrained=default"]
    saved, sys.argv = sys.argv, ["mlxcache-kernel eval", "run", *argv]
    try:
        cli_evaluate()
    except SystemExit as e:  # argparse's own usage errors and --help
        return e.code if isinstance(e.code, int) else 1
    except Exception as e:  # noqa: BLE001 (a task it cannot load, a bad model argument: one line)
        print(f"mlxcache-kernel eval: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    finally:
        sys.argv = saved
    return 0
