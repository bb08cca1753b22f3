"""``%eval``: lm-evaluation-harness tasks on a loaded model through the kernel's engine
(`mlxcache_kernel.eval.CachedLM`: few-shot blocks and contexts from the cache), with progress
bars and a table of the results."""

from __future__ import annotations

import keyword

from IPython.core.error import UsageError
from IPython.core.magic import line_magic, magics_class
from IPython.core.magic_arguments import argument, kwds, magic_arguments

from .base import EngineMagics, parse_args, usage_errors
from .help import examples
from .tables import show_table


@magics_class
class EvalMagics(EngineMagics):
    @magic_arguments()
    @kwds(epilog=examples("eval"))
    @argument("tasks", help="the harness's task names, comma-separated (e.g. mmlu,hellaswag)")
    @argument("--num-fewshot", "-k", type=int, default=None, help="few-shot examples per question (default: task's)")
    @argument("--limit", "-l", type=float, default=None, help="at most this many documents per task (< 1: a fraction)")
    @argument("--include-path", default=None, help="a folder of task YAML files of your own")
    @argument("--model", "-m", default=None, help="model name (default: the current default model)")
    @argument("--chat", action="store_true", help="apply the model's chat template to the prompts")
    @argument("--seed", type=int, default=0, help="the harness's seeds (few-shot sampling) (default 0)")
    @argument("--out", "-o", default=None, help="store the harness's results dict in this variable")
    @line_magic("eval")
    @usage_errors
    def eval_(self, line):
        """Evaluate the model on lm-evaluation-harness tasks (needs the [eval] extra).

        Log-likelihoods go through Engine.score_groups (a task's few-shot block prefilled once,
        each question's context once for its choices, the choices batched; a rerun takes them
        from RAM, after a restart from SSD); generations through generate_batch. The table shows
        each task's metrics; --out keeps the harness's whole results dict.
        """
        args = parse_args(self.eval_, line)
        if args.out is not None and (not args.out.isidentifier() or keyword.iskeyword(args.out)):
            raise UsageError(f"--out needs a variable name, got {args.out!r}")
        tasks = [t for t in args.tasks.split(",") if t]
        if not tasks:
            raise UsageError("give one or more task names, comma-separated")
        try:
            import lm_eval
            from lm_eval.tasks import TaskManager

            from ..eval import CachedLM
        except ImportError:
            raise UsageError("%eval needs lm-evaluation-harness: pip install 'mlxcache-kernel[eval]'") from None
        self._ensure_model(args.model)
        lm = CachedLM(engine=self.engine, model=args.model, seed=args.seed)
        limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
        try:
            manager = TaskManager(include_path=args.include_path) if args.include_path else None
            results = lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=args.num_fewshot, limit=limit,
                                              task_manager=manager, apply_chat_template=args.chat,
                                              random_seed=args.seed, numpy_random_seed=args.seed,
                                              torch_random_seed=args.seed, fewshot_random_seed=args.seed,
                                              verbosity="ERROR")
        except (KeyError, ValueError, FileNotFoundError) as e:  # a task the harness cannot find or load
            raise UsageError(f"the harness could not run {args.tasks}: {e}") from None
        rows = []
        for task, values in results["results"].items():
            for key, value in values.items():
                metric, _, flt = key.partition(",")
                if flt and not metric.endswith("_stderr") and isinstance(value, (int, float)):
                    err = values.get(f"{metric}_stderr,{flt}")
                    rows.append({"task": task, "metric": metric, "filter": flt, "value": f"{value:.4f}",
                                 "stderr": f"{err:.4f}" if isinstance(err, (int, float)) else ""})
        show_table(rows, ["task", "metric", "filter", "value", "stderr"])
        if args.out:
            self.shell.user_ns[args.out] = results
