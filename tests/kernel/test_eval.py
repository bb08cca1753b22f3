"""lm-evaluation-harness over the engine (issue 48, `mlxcache_kernel.eval.CachedLM`): the harness
runs local tasks (a task YAML over a JSONL, no network) with it; per-request log-likelihoods equal
`mlx_lm.evaluate`'s within 1e-4, greedy flags, generations and metrics identical; a rerun and a
restart prefill nothing; an adapter shares nothing; the harness's rules for an empty
context, a long context and rolling windows; clear errors."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the local tasks' data files only
os.environ.setdefault("HF_HUB_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")  # the [eval] extra (scripts/setup.sh installs it)

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from local_tasks import write_tasks  # noqa: E402
from tiny_adapter import build_adapter  # noqa: E402

from mlxcache_kernel.engine import ConfigError, Engine, GenerationError, ModelError  # noqa: E402
from mlxcache_kernel.eval import CachedLM  # noqa: E402


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tasks")
    names = write_tasks(folder)
    return names, TaskManager(include_path=str(folder), include_defaults=False)


def evaluate(lm, tasks, which=("mc", "gen")) -> dict:
    names, manager = tasks
    return lm_eval.simple_evaluate(model=lm, tasks=[names[w] for w in which], task_manager=manager,
                                   log_samples=True, verbosity="ERROR")


def responses(result: dict, task: str) -> list:
    return [s["resps"] for s in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


def metrics(result: dict) -> dict:
    return {task: {k: float(v) for k, v in r.items() if "," in k} for task, r in result["results"].items()}


def prefilled(eng: Engine) -> int:
    return eng.stats()["engine_prefilled_tokens"]


def test_the_harness_scores_as_mlx_lm_evaluate_does(tiny_model_dir, tmp_path, tasks):
    from mlx_lm.evaluate import MLXLM

    lm = CachedLM(pretrained=str(tiny_model_dir), cache_dir=str(tmp_path / "c"))
    try:
        ours = evaluate(lm, tasks)
    finally:
        lm.close()
    theirs = evaluate(MLXLM(str(tiny_model_dir), use_chat_template=False), tasks)
    names = tasks[0]
    a, b = responses(ours, names["mc"]), responses(theirs, names["mc"])
    assert len(a) == 12 and all(len(x) == 4 for x in a)
    for xs, ys in zip(a, b):
        for (lp, greedy), (want, want_greedy) in zip((x[0] for x in xs), (y[0] for y in ys)):
            assert abs(lp - want) <= 1e-4 and bool(greedy) == bool(want_greedy)
    assert responses(ours, names["gen"]) == responses(theirs, names["gen"])
    assert metrics(ours) == metrics(theirs)


def test_a_rerun_and_a_restart_prefill_nothing_and_an_adapter_shares_nothing(tiny_model_dir, tmp_path, tasks):
    with Engine(cache_dir=tmp_path / "c") as eng:  # a notebook's engine
        eng.load_model(tiny_model_dir, name="m")
        lm = CachedLM(engine=eng, model="m")
        first = evaluate(lm, tasks, ["mc"])
        before = prefilled(eng)
        assert before > 0
        again = evaluate(lm, tasks, ["mc"])
        assert prefilled(eng) == before  # every context from RAM
        assert metrics(again) == metrics(first)
    lm = CachedLM(pretrained=str(tiny_model_dir), cache_dir=str(tmp_path / "c"))  # a restart: from SSD
    try:
        restarted = evaluate(lm, tasks, ["mc"])
        assert prefilled(lm.engine) == 0
        assert metrics(restarted) == metrics(first)
    finally:
        lm.close()
    adapter = build_adapter(tiny_model_dir, tmp_path / "adapter")
    lm = CachedLM.create_from_arg_string(f"pretrained={tiny_model_dir},adapter={adapter},cache_dir={tmp_path / 'c'}")
    try:
        evaluate(lm, tasks, ["mc"])  # an adapter: its own namespace, nothing of the base model's
        assert prefilled(lm.engine) == before
    finally:
        lm.close()


@pytest.fixture(scope="module")
def small_window(tiny_model_dir, tmp_path_factory):
    lm = CachedLM(pretrained=str(tiny_model_dir), cache_dir=str(tmp_path_factory.mktemp("w")), max_length=32)
    yield lm
    lm.close()


def request(kind: str, *args) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def test_the_harness_rules_for_an_empty_context_a_long_one_and_rolling_windows(small_window):
    lm, eng = small_window, small_window.engine
    prefix = lm.prefix_token_id
    text = "the keeper climbed the stairs of the lighthouse at dusk and lit the lamp"
    long_context = " ".join([text] * 3)
    [(empty, _), (cut, _)] = lm.loglikelihood([request("loglikelihood", "", " lamp"),
                                               request("loglikelihood", long_context, " lamp")],
                                              disable_tqdm=True)
    assert empty == pytest.approx(eng.score([prefix], [lm.encode(" lamp", special=False)])[0].logprob, abs=1e-4)
    ctx = lm.encode(long_context)
    cont = lm.encode(long_context + " lamp")[len(ctx):]
    kept = ctx[-(33 - len(cont)):]  # the model attends over 32 positions: the context cut from the left
    assert cut == pytest.approx(eng.score(kept, [cont])[0].logprob, abs=1e-4)
    # a document longer than the window: the harness's disjoint windows, each scored as score does
    tokens = lm.encode(long_context)
    [total] = lm.loglikelihood_rolling([request("loglikelihood_rolling", long_context)], disable_tqdm=True)
    want = eng.score([prefix], [tokens[:32]])[0].logprob  # the first window: all of its tokens predicted
    done = 32
    while done < len(tokens):
        n = min(32, len(tokens) - done)
        window = tokens[done + n - 33 : done - 1 + n]
        want += eng.score(window[: len(window) - (n - 1)], [tokens[done : done + n]])[0].logprob
        done += n
    assert total == pytest.approx(want, abs=1e-3)
    with pytest.raises(GenerationError, match="longer than the model's length"):
        lm.loglikelihood([request("loglikelihood", "a", " " + long_context)], disable_tqdm=True)


def test_generations_stop_at_their_strings_and_give_max_gen_toks_room(small_window):
    lm, eng = small_window, small_window.engine
    prompt = "the keeper"  # (the tiny model's tokens are bytes: 10 of the 32 positions)
    tokens = eng.generate_tokens(lm.encode(prompt), max_tokens=8).tokens
    full = lm.tokenizer.decode([t for t in tokens if t not in eng.models.get().eos_token_ids])
    stop = full[2:4]
    [plain, stopped] = lm.generate_until([request("generate_until", prompt, {"max_gen_toks": 8, "until": []}),
                                          request("generate_until", prompt, {"max_gen_toks": 8, "until": [stop]})],
                                         disable_tqdm=True)
    assert plain == full and stopped == full.split(stop)[0]
    with pytest.raises(GenerationError, match="leaves no room"):
        lm.generate_until([request("generate_until", prompt, {"max_gen_toks": 32})], disable_tqdm=True)


def test_bad_model_arguments_are_clear_errors(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="pretrained=PATH .* or engine=ENGINE"):
        CachedLM()
    with Engine(cache_dir=tmp_path / "c", ssd=False) as eng:
        eng.load_model(tiny_model_dir, name="m")
        with pytest.raises(ConfigError, match="kv_bits apply to a model being loaded"):
            CachedLM(engine=eng, model="m", kv_bits=8)
    with pytest.raises(ModelError, match="not an mlx-lm adapter directory"):
        CachedLM.create_from_arg_string(f"pretrained={tiny_model_dir},adapter={tmp_path},cache_dir={tmp_path / 'd'}")
    with pytest.raises(TypeError, match="unexpected keyword argument 'temperture'"):
        CachedLM.create_from_arg_string(f"pretrained={tiny_model_dir},temperture=0")


def test_the_command_line_runs_the_harness_with_the_cached_engine(tiny_model_dir, tmp_path, tasks):
    import json
    import subprocess
    import sys

    folder = tmp_path / "tasks"
    names = write_tasks(folder, suffix="_cli")
    from pathlib import Path

    command = str(Path(sys.executable).parent / "mlxcache-kernel")  # the installed console script
    cli = [command, "eval", "--tasks", names["mc"], "--include_path", str(folder)]
    model_args = ["--model_args", f"pretrained={tiny_model_dir},cache_dir={tmp_path / 'c'}"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([*cli, *model_args, "--output_path", str(tmp_path / "out")], capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "mlxcache" in done.stdout and "acc" in done.stdout  # the harness's table
    [saved] = (tmp_path / "out").rglob("results_*.json")
    acc = json.loads(saved.read_text())["results"][names["mc"]]["acc,none"]
    lm = CachedLM(pretrained=str(tiny_model_dir), cache_dir=str(tmp_path / "c"))
    try:
        assert metrics(evaluate(lm, (names, TaskManager(include_path=str(folder), include_defaults=False)),
                                ["mc"]))[names["mc"]]["acc,none"] == acc
        assert prefilled(lm.engine) == 0  # the command's engine wrote every context to the shared directory
    finally:
        lm.close()
    bad = subprocess.run([command, "eval", "--tasks", "no_such_task", *model_args], capture_output=True, text=True,
                         env=env, timeout=600)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == (
        "mlxcache-kernel eval: ValueError: Tasks not found: no_such_task")


@pytest.mark.smollm
def test_generations_keep_their_leading_space_as_mlx_lm_evaluate_does(default_model_dir, tmp_path):
    """A streaming detokenizer drops the first token's leading space; the harness's models keep it
    (' Copper' scores exact_match against ' Copper', 'Copper' does not)."""
    from mlx_lm.evaluate import MLXLM

    names = write_tasks(tmp_path / "tasks", questions=2, prompts=3)
    manager = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False)
    lm = CachedLM(pretrained=str(default_model_dir), cache_dir=str(tmp_path / "c"))
    try:
        ours = evaluate(lm, (names, manager), ["gen"])
    finally:
        lm.close()
    theirs = evaluate(MLXLM(str(default_model_dir), use_chat_template=False), (names, manager), ["gen"])
    got = responses(ours, names["gen"])
    assert got == responses(theirs, names["gen"]) and any(g[0][0].startswith(" ") for g in got)


def test_the_eval_magic_runs_tasks_on_the_kernels_engine(ip, capsys, tmp_path):
    from magics_shell import engine, run, usage_error

    folder = tmp_path / "tasks"
    names = write_tasks(folder, suffix="_magic")
    res, out, err = run(ip, capsys, f"%eval {names['mc']} --include-path {folder} --limit 6 --out r")
    assert res.success, err
    lines = out.strip().splitlines()
    table = lines[next(i for i, line in enumerate(lines) if line.startswith("task")):]
    assert table[0].split() == ["task", "metric", "filter", "value", "stderr"] and table[2].split()[:3] == [
        names["mc"], "acc", "none"]
    acc = ip.user_ns["r"]["results"][names["mc"]]["acc,none"]
    assert f"{acc:.4f}" in table[2]
    before = prefilled(engine(ip))
    run(ip, capsys, f"%eval {names['mc']} --include-path {folder} --limit 6")
    assert prefilled(engine(ip)) == before  # the rerun: every context from the kernel's cache
    assert "could not run no_such_task" in usage_error(ip, capsys, f"%eval no_such_task --include-path {folder}")
    assert "--out needs a variable name" in usage_error(ip, capsys, f"%eval {names['mc']} --out 1x")
