"""lm-evaluation-harness tasks on local files (no network): a harness task YAML over a JSONL this
writes. A multiple-choice task whose few-shot block is the same before every question (the
`first_n` sampler over a train split, as MMLU's few-shot gives) and a `generate_until` task.
Used by tests/kernel/test_eval.py and benchmarks/bench_eval.py."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ("river stone copper lantern harbor meadow signal orchard winter compass ledger canyon violet "
         "engine saddle market beacon thistle granite feather").split()


def _question(rng: random.Random, i: int, detail: int) -> dict:
    a, b = rng.randrange(2, 60), rng.randrange(2, 60)
    word = rng.choice(WORDS)
    answer = rng.randrange(4)
    right = a + b
    wrong = [right + d for d in rng.sample([-3, -2, -1, 1, 2, 3, 10], 3)]
    choices = wrong[:answer] + [right] + wrong[answer:]
    notes = "".join(f"Note {k + 1}: the {rng.choice(WORDS)} ledger of {rng.choice(WORDS)} row listed "
                    f"{rng.randrange(100, 999)} entries in week {rng.randrange(1, 52)}. " for k in range(detail))
    return {"question": f"{notes}The {word} count started at {a} and {b} more were added. How many are there now?",
            "choices": [str(c) for c in choices], "answer": answer, "id": i}


def write_tasks(folder: Path, *, questions: int = 12, shots: int = 5, prompts: int = 6, detail: int = 0,
                max_gen_toks: int = 24, suffix: str = "") -> dict:
    """Write the tasks' data and YAML files under `folder`; returns the task names
    {"mc": ..., "gen": ...} (pass `include_path=folder` to the harness's TaskManager). detail: notes
    (some 20 tokens each) before every question, to make the questions (and the few-shot block) longer."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(48)
    _jsonl(folder / "mc_train.jsonl", [_question(rng, i, detail) for i in range(shots)])
    _jsonl(folder / "mc_test.jsonl", [_question(rng, 1000 + i, detail) for i in range(questions)])
    gen = [{"question": f"Name a word that rhymes with {w}.", "answer": w} for w in (WORDS * 8)[:prompts]]
    _jsonl(folder / "gen_test.jsonl", gen)
    mc, gen_name = f"local_mc{suffix}", f"local_gen{suffix}"
    (folder / f"{mc}.yaml").write_text(f"""task: {mc}
dataset_path: json
dataset_kwargs:
  data_files:
    train: {folder / 'mc_train.jsonl'}
    test: {folder / 'mc_test.jsonl'}
training_split: train
test_split: test
fewshot_split: train
fewshot_config:
  sampler: first_n
num_fewshot: {shots}
output_type: multiple_choice
description: "The following are questions about counting, with answers.\\n\\n"
doc_to_text: "Question: {{{{question}}}}\\nA. {{{{choices[0]}}}}\\nB. {{{{choices[1]}}}}\\nC. {{{{choices[2]}}}}\\nD. {{{{choices[3]}}}}\\nAnswer:"
doc_to_choice: ["A", "B", "C", "D"]
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    (folder / f"{gen_name}.yaml").write_text(f"""task: {gen_name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'gen_test.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: answer
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: {max_gen_toks}
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")
    return {"mc": mc, "gen": gen_name}


def _jsonl(path: Path, rows: list) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
