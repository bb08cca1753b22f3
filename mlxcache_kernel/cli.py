"""Command line: ``mlxcache-kernel <command> ...``.

Each command is a function taking the parsed ``argparse.Namespace`` and
returning an exit code; ``build_parser`` wires it up with
``set_defaults(func=...)``. Heavy imports (MLX, IPython) happen inside the
command functions, never at module level.
"""

from __future__ import annotations

import argparse
import sys

DTYPES = ("float32", "bfloat16", "float16")


def cmd_models_default(args: argparse.Namespace) -> int:
    """Convert the default model if needed and print its directory."""
    from mlxcache_kernel.engine.models.convert import ensure_default_model

    try:
        path = ensure_default_model(dtype=args.dtype, models_dir=args.models_dir)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _add_models(subparsers) -> None:
    models = subparsers.add_parser("models", help="manage local models")
    models_sub = models.add_subparsers(dest="models_command", metavar="<models command>")
    models_sub.required = True
    default = models_sub.add_parser(
        "default",
        help="convert the bundled SmolLM2-135M-Instruct GGUF (once) and print the model directory",
    )
    default.add_argument("--dtype", choices=DTYPES, default="float32", help="weight dtype (default: float32)")
    default.add_argument(
        "--models-dir",
        default=None,
        help="where converted models live (default: $MLXCACHE_MODELS_DIR or ~/.cache/mlxcache-kernel/models)",
    )
    default.set_defaults(func=cmd_models_default)


def cmd_demo(args: argparse.Namespace) -> int:
    """Load the default model, generate cold, then rerun the same prompt from the RAM cache."""
    import tempfile

    from mlxcache_kernel.engine import Engine
    from mlxcache_kernel.engine.models.convert import ensure_default_model

    prompt = args.prompt
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="mlxcache-demo-")
    with Engine(cache_dir=cache_dir) as eng:
        eng.load_model(str(ensure_default_model()), name="smollm2")
        print(f"BLAS: {eng.stats()['blas']}")
        for label in ("cold run", "cached rerun"):
            r = eng.generate(prompt, max_tokens=args.max_tokens)
            s = r.stats
            print(f"\n== {label}: {r.text.strip()}")
            print(
                f"   prompt {s['prompt_tokens']} tokens: {s['cached_tokens']} from {s['cache_source'] or '-'}, "
                f"{s['prefilled_tokens']} prefilled in {s['prefill_s']:.3f}s; TTFT {s['ttft_s']:.3f}s; "
                f"decode {s['decode_tokens_per_s'] or 0:.1f} tok/s"
            )
    return 0


def _add_demo(subparsers) -> None:
    demo = subparsers.add_parser("demo", help="generate on the default model: a cold run, then a cached rerun")
    demo.add_argument(
        "--prompt",
        default="In three sentences, explain why caching a long prompt's KV state saves time.",
    )
    demo.add_argument("--max-tokens", type=int, default=48)
    demo.add_argument("--cache-dir", default=None, help="cache directory (default: a fresh temporary one)")
    demo.set_defaults(func=cmd_demo)


def cmd_eval(args: argparse.Namespace) -> int:
    from mlxcache_kernel.eval import run_harness  # lm-eval: the [eval] extra

    return run_harness(args.harness_args)


def _add_eval(subparsers) -> None:
    ev = subparsers.add_parser(
        "eval", help="run lm-evaluation-harness with the cached engine (its arguments; the [eval] extra)",
        description="lm-evaluation-harness's own arguments (lm-eval run --help), with --model mlxcache and "
                    "--model_args pretrained=default unless given; model arguments: pretrained, kv_bits, "
                    "kv_group_size, kv_start, adapter, draft, cache_dir, add_bos_token, max_length, seed.",
        add_help=False)
    ev.add_argument("harness_args", nargs=argparse.REMAINDER, help="the harness's arguments")
    ev.set_defaults(func=cmd_eval)


def _add_kernel_commands(subparsers) -> None:
    """install, lab (mlxcache_kernel.kernelspec) and run (mlxcache_kernel.runner)."""
    from mlxcache_kernel import kernelspec, runner

    kernelspec.add_commands(subparsers)
    runner.add_commands(subparsers)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlxcache-kernel", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", metavar="<command>")
    subparsers.required = True
    _add_models(subparsers)
    _add_demo(subparsers)
    _add_eval(subparsers)
    _add_kernel_commands(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    from mlxcache_kernel.engine.host.blas import ensure_fast_blas

    given = sys.argv[1:] if argv is None else list(argv)
    if given[:1] == ["eval"]:  # every argument after it is the harness's (argparse would claim its options)
        args = argparse.Namespace(func=cmd_eval, harness_args=given[1:])
    else:
        args = build_parser().parse_args(argv)
    if argv is None:  # a real process we own: restart it with OpenBLAS preloaded if that helps
        ensure_fast_blas()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
