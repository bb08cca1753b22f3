"""Crash records of agent loops: after each step of a loop (chat/turn.py) the calls it made, their
results and the ids the model generated are written to a small JSON file under the cache directory, so
a loop killed mid-way (kill -9, an interrupt, an error) and run again continues after its last
completed step: the recorded steps replay (their tools are not run again; their states are in the
cache, under the same ids) and the result is what an uninterrupted loop returns. A loop that ends
removes its record.

A loop is the same request when its first prompt (the ids: the conversation so far, the tools as the
template renders them), the model's namespace, the sampling settings, the tools' schemas, the tool
choice and the step limit are. A result that is not JSON replays as the text the model read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import blake3

from ..generate.generation import GenerationResult
from ..host import safe_dirs
from .tools import ToolCall


@dataclass
class Replay:
    result: GenerationResult
    calls: list


class LoopRecord:
    def __init__(self, path: Path, root: Path):
        self.path, self.root = path, root  # root: the cache directory (nothing written through a link)
        try:
            self.steps = json.loads(path.read_text())["steps"]
        except (OSError, ValueError, KeyError, TypeError):
            self.steps = []

    def replay(self, i: int, prompt_ids: list) -> Replay | None:
        """Step i as the record holds it, or None (not reached, or a record that does not fit)."""
        if i >= len(self.steps):
            return None
        step = self.steps[i]
        if step.get("prompt_tokens") != len(prompt_ids):
            self.steps = self.steps[:i]  # the conversation went elsewhere: generate from here
            return None
        calls = [ToolCall(c["name"], c["arguments"], c["id"], c.get("result"), c.get("error")) for c in step["calls"]]
        stats = {**step["stats"], "replayed": True}
        return Replay(GenerationResult(step["text"], step["tokens"], stats, list(prompt_ids)), calls)

    def add(self, result: GenerationResult, calls: list) -> None:
        self.steps.append({
            "prompt_tokens": len(result.prompt_tokens), "tokens": list(result.tokens), "text": result.text,
            "stats": {k: v for k, v in result.stats.items() if isinstance(v, (int, float, str, bool, type(None)))},
            "calls": [{"name": c.name, "arguments": c.arguments, "id": c.id, "result": _json(c.result),
                       "error": c.error} for c in calls]})
        try:
            safe_dirs.write_json_atomic(self.path, {"steps": self.steps}, root=self.root)
        except OSError:  # a full disk, a link: the loop goes on unrecorded (a rerun runs its tools again)
            pass

    def finish(self) -> None:
        safe_dirs.unlink(self.path, self.root)


class LoopRecords:
    """The records under `directory`, inside the cache directory (None: no SSD tier, no records)."""

    def __init__(self, directory: Path | None):
        self.directory = None
        if directory is not None:
            try:
                self.directory = safe_dirs.make_private_dir(directory, Path(directory).parent)
            except OSError:  # (a link: reported by safe_dirs; no records then)
                pass

    def opener(self, namespace: str, params: dict):
        """records(ids, schemas, choice, max_steps) for a turn (chat/turn.py), or None."""
        if self.directory is None:
            return None

        def open_record(ids: list, schemas: list, choice: str, max_steps: int) -> LoopRecord:
            key = json.dumps([namespace, [int(t) for t in ids], params, schemas, choice, max_steps], sort_keys=True,
                             default=str)
            name = f"{blake3.blake3(key.encode()).hexdigest()[:32]}.json"
            return LoopRecord(self.directory / name, self.directory.parent)

        return open_record


def _json(value):
    """The result as JSON keeps it: itself when it round-trips, else its text."""
    try:
        return value if json.loads(json.dumps(value)) == value else repr(value)
    except (TypeError, ValueError):
        return repr(value)
