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
    from mlxcache_kernel.engine.convert import ensure_default_model

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlxcache-kernel", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", metavar="<command>")
    subparsers.required = True
    _add_models(subparsers)
    # Further commands (install, demo, ...) register here with their own _add_* function.
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
