"""Sampling: the parameters every generation path takes, and samplers whose state is (seed, step).

The key for step i depends only on the seed and i, so a generation restored
at step k (a resume, a batch row, a speculative verification) draws exactly
what the uninterrupted run would have.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import mlx.core as mx

from mlx_lm.sample_utils import apply_top_k, apply_top_p

from .logprobs import MAX_TOP
from ..errors import GenerationError  # noqa: F401 (raised here; defined in errors.py)



def _option(default, *flags: str, help: str, repeat: bool = False, type=None):
    """A sampling option: its default, and how the magics spell it (flags, help; repeat: a list)."""
    return field(default=default, metadata={"flags": flags, "help": help, "repeat": repeat,
                                            "type": type or (default.__class__ if default is not None else str)})


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn: the one definition of the sampling options `generate`, `generate_batch`
    and the ``%%generate`` magics take (their flags and help are the fields' metadata)."""

    max_tokens: int = _option(256, "--max-tokens", "-n", help="most tokens to generate (default 256)")
    temperature: float = _option(0.0, "--temperature", "-t", help="sampling temperature; 0 = greedy (default)")
    top_p: float = _option(1.0, "--top-p", help="nucleus sampling mass in (0, 1] (default 1)")
    top_k: int = _option(0, "--top-k", help="keep the k most likely tokens; 0 = all (default)")
    seed: int = _option(0, "--seed", "-s", help="sampling seed; same seed, same text (default 0)")
    stop: tuple = _option((), "--stop", help="stop string (repeatable)", repeat=True)
    logprobs: int | None = _option(None, "--logprobs", type=int,
                                   help=f"record each token's log-probability and the K most likely alternatives "
                                        f"(0: the token's alone; at most {MAX_TOP})")

    @classmethod
    def of(cls, **options) -> "SamplingParams":
        """From keyword options (numbers as given, stop strings as a sequence); an unknown
        name is a TypeError naming the options."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise TypeError(f"unknown sampling option(s) {', '.join(unknown)}; the options are {', '.join(names)}")
        if "stop" in options:
            stop = options["stop"]
            options["stop"] = (stop,) if isinstance(stop, str) else tuple(stop or ())
        for name, cast in (("temperature", float), ("top_p", float), ("top_k", int)):
            if isinstance(options.get(name), (int, float)) and not isinstance(options[name], bool):
                options[name] = cast(options[name])
        return cls(**options)

    @classmethod
    def names(cls) -> tuple:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_call(cls, params: "SamplingParams | None", options: dict, others=frozenset()) -> "SamplingParams":
        """A call's sampling (Engine.generate, generate_tokens): params=SamplingParams(...) or the sampling
        options, taken out of `options`, never both; any other name not in `others` is a TypeError."""
        given = {k: options.pop(k) for k in cls.names() if k in options}
        unknown = sorted(set(options) - set(others))
        if unknown:
            also = f"; the others {', '.join(sorted(others))}" if others else ""
            raise TypeError(f"unknown option(s) {', '.join(unknown)}; the sampling options are "
                            f"{', '.join(cls.names())}{also}")
        if params is None:
            return cls.of(**given)
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if given:
            raise TypeError(f"pass params= or the sampling options ({', '.join(sorted(given))}), not both")
        return params

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise GenerationError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise GenerationError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise GenerationError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise GenerationError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if vocab_size is not None and self.top_k >= vocab_size:
            raise GenerationError(f"top_k must be below the vocabulary size {vocab_size}, got {self.top_k}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise GenerationError(f"seed must be an integer >= 0, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise GenerationError("stop strings must be non-empty strings")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_TOP):
            raise GenerationError(f"logprobs must be an integer from 0 to {MAX_TOP} (alternatives per token), "
                                  f"got {self.logprobs!r}")
        if self.logprobs is not None and vocab_size is not None and self.logprobs > vocab_size:
            raise GenerationError(f"logprobs must be at most the vocabulary size {vocab_size}")
        return self

    def as_dict(self) -> dict:
        """The options as JSON (a resume record's identity): logprobs only when asked for."""
        d = asdict(self)
        d["stop"] = list(self.stop)
        if d["logprobs"] is None:
            del d["logprobs"]
        return d


def _mix64(x: int) -> int:
    """SplitMix64 finalizer: decorrelates (seed, step) pairs."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def step_key(seed: int, step: int) -> mx.array:
    return mx.random.key(_mix64(_mix64(seed) ^ step) & 0x7FFFFFFFFFFFFFFF)


def sample(logits: mx.array, params: SamplingParams, step: int) -> mx.array:
    """One token id (shape (1,)) from last-position logits of shape (1, vocab)."""
    if params.temperature == 0:
        return mx.argmax(logits, axis=-1)
    return sample_logprobs(logits - mx.logsumexp(logits, axis=-1, keepdims=True), params, step)


def sample_logprobs(logprobs: mx.array, params: SamplingParams, step: int) -> mx.array:
    """`sample` from normalized log-probabilities (what mlx-lm's batch samplers are given)."""
    if params.temperature == 0:
        return mx.argmax(logprobs, axis=-1)
    if 0 < params.top_p < 1:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.top_k > 0:
        logprobs = apply_top_k(logprobs, params.top_k)
    return mx.random.categorical(logprobs * (1 / params.temperature), key=step_key(params.seed, step))
