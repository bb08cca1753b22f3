"""Tools for the agent-loop tests (tests/engine/chat/test_agent_loop.py) and their worker process: every
call is appended to a log file (what ran, in order), so a test can tell whether a tool ran twice. The
arguments are enums, so a tiny random model's forced calls stay short.

`python agent_tools.py CACHE_DIR MODEL_DIR LOG KILL_AT` runs the test's loop in a fresh process and prints its
result as JSON; with KILL_AT = n the n-th call kills the process (SIGKILL) while its tool runs.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Literal

LOG: Path | None = None  # where calls are logged
KILL_AT = 0  # the call that kills the process (0: none)
OFFSET = 0  # added to every reading: another run's tool results differ


def _logged(name: str, args: dict) -> None:
    """Log a call (a run's results never depend on the log: a resumed run must answer as a whole one)."""
    lines = LOG.read_text().splitlines() if LOG is not None and LOG.exists() else []
    lines.append(json.dumps([name, args]))
    if LOG is not None:
        LOG.write_text("\n".join(lines) + "\n")
    if KILL_AT and len(lines) == KILL_AT:
        os.kill(os.getpid(), signal.SIGKILL)  # kill -9 while the tool runs


def weather(city: Literal["paris", "oslo"], days: Literal[1, 2]) -> dict:
    """The weather forecast.

    Args:
        city: The city
        days: How many days ahead
    """
    _logged("weather", {"city": city, "days": days})
    return {"city": city, "celsius": 20 + days + OFFSET}


def convert(celsius: Literal[20, 25]) -> str:
    """Celsius in Fahrenheit.

    Args:
        celsius: Degrees Celsius
    """
    _logged("convert", {"celsius": celsius})
    return f"{celsius * 9 / 5 + 32 + OFFSET:.1f} F"


TOOLS = [weather, convert]
QUESTION, SYSTEM = "What should I wear in Oslo?", "You are a careful assistant. " * 20
LOOP = dict(tools=TOOLS, tool_choice="required", max_steps=6, max_tokens=300, seed=0)


def summary(r) -> dict:
    return {"text": r.text, "tokens": r.tokens, "steps": [[s.call, s.arguments, s.result, s.tokens] for s in r.steps],
            "replayed": sum(1 for s in r.steps if s.stats.get("replayed"))}


if __name__ == "__main__":
    from mlxcache_kernel.engine import Engine

    cache_dir, model_dir, LOG, KILL_AT = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
    with Engine(cache_dir=cache_dir, prefetch_budget_bytes=0) as eng:
        eng.load_model(model_dir, name="m")
        print(json.dumps(summary(eng.generate(QUESTION, session="trip", system=SYSTEM, **LOOP))), flush=True)
