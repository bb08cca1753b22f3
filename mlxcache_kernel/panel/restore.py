""""Restore into this notebook": what the panel asks the notebook's own kernel to run.

The panel sends a silent execution whose user expression is ``restore(NAME)``; the answer's
plain-text form is JSON (``{"ok", "message", ...}``) the panel parses and shows. The name is
checked whole before anything else; the restore itself is ``%checkpoint restore NAME``'s.
"""

from __future__ import annotations

import json


class Answer(dict):
    """A dict whose repr is its JSON: what a user expression's text/plain reply carries."""

    def __repr__(self) -> str:
        return json.dumps(self)

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(repr(self))


def restore(name) -> Answer:
    from mlxcache_kernel.engine.named.checkpoints import CheckpointNameError, check_name
    from mlxcache_kernel.extension import get_engine
    from mlxcache_kernel.magics.tables import describe_checkpoint

    try:
        check_name(name)
        info = get_engine().checkpoints.restore(name)
    except (CheckpointNameError, ValueError, LookupError, OSError, RuntimeError) as e:
        return Answer(ok=False, message=str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
    done = "loading from SSD in the background" if info.get("source") == "loading" else "restored"
    return Answer(ok=True, message=f"checkpoint {name!r} {done}{describe_checkpoint(info)}", source=info.get("source"),
                  tokens=info.get("tokens"), session=info.get("session"))
