"""Named checkpoints: user names pinned to exact token prefixes.

A name is a small JSON record in `<cache_dir>/names/` (0600) pointing at a
checkpoint by namespace and exact tokens, with the chat session it came from
(if any). The KV itself lives in the tiered cache; the records are the truth
for the catalogue's pins (which every process honors: no cap, clear or
supersession deletes a pinned file), and RAM may demote a named checkpoint
once it is durable on SSD.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from .names import check_user_name
from ..host import safe_dirs
from ..errors import CheckpointNameError, LinkedDirectory  # noqa: F401 (raised here; defined in errors.py)



def check_name(name: str) -> str:
    return check_user_name(name, "checkpoint name", CheckpointNameError)


class NamedCheckpoints:
    """Records in `directory`; None when the cache directory cannot be written (no names then).
    The directory is opened from its parent without following links: one that is a link is
    reported (host/safe_dirs.py) and names are off, nothing behind it touched."""

    def __init__(self, directory: Path | None):
        self.dir = None
        if directory is not None:
            try:
                self.dir = safe_dirs.make_private_dir(directory, Path(directory).parent)
            except LinkedDirectory:
                pass

    @classmethod
    def reading(cls, directory: Path) -> "NamedCheckpoints":
        """The records as another process reads them (the panel): nothing created or changed."""
        names = cls(None)
        names.dir = Path(directory) if Path(directory).is_dir() else None
        return names

    def _path(self, name: str) -> Path:
        if self.dir is None:
            raise CheckpointNameError("named checkpoints need a writable cache directory (see %cache stats)")
        return self.dir / f"{check_name(name)}.json"

    def save(self, name: str, record: dict) -> dict:
        record = {**record, "name": name, "saved": time.time()}
        safe_dirs.write_json_atomic(self._path(name), record, root=self.dir.parent)
        return record

    def get(self, name: str) -> dict:
        path = self._path(name)
        try:
            record = json.loads(path.read_text())
        except FileNotFoundError:
            known = ", ".join(sorted(r["name"] for r in self.list())) or "none"
            raise CheckpointNameError(f"unknown checkpoint {name!r}; saved: {known}") from None
        except (OSError, ValueError) as e:
            raise CheckpointNameError(f"checkpoint record {name!r} is unreadable: {e}") from None
        return record

    def remove(self, name: str) -> dict:
        record = self.get(name)
        if not safe_dirs.unlink(self._path(name), self.dir.parent):
            raise CheckpointNameError(f"checkpoint record {name!r} could not be removed (see %cache stats)")
        return record

    def list(self) -> list[dict]:
        out = []
        try:
            names = sorted(safe_dirs.listdir(self.dir, self.dir.parent)) if self.dir is not None else []
        except OSError:  # (a link now: reported)
            names = []
        for name in (n for n in names if n.endswith(".json") and not n.startswith(".")):
            try:
                out.append(json.loads((self.dir / name).read_text()))
            except (OSError, ValueError):
                continue  # a damaged record is skipped, not fatal
        return out

