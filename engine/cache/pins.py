"""Named checkpoints' pins in the shared catalogue: no process's cap, clear or supersession deletes a
pinned file. The named records (named/checkpoints.py) are the truth; the catalogue's pins follow them,
at once, or with the catalogue busy once it is free (its keeper)."""

from __future__ import annotations

from typing import Callable, Sequence

from ..kv.tokens import token_key
from .catalog.database import CatalogBusy
from .ssd.store import CheckpointStore


class CatalogPins:
    def __init__(self, store: CheckpointStore | None):
        self.store = store
        self.source: Callable[[], dict] = dict  # name -> (namespace, tokens) of the named records

    def set(self, name: str, ns: str | None, tokens: Sequence[int] | None) -> None:
        """Pin `name` to (ns, tokens), or unpin it (None); busy: all of them once it is free."""
        try:
            self.store.catalog.set_pin(name, ns, None if tokens is None else token_key(tokens))
        except CatalogBusy:
            self.store.catalog.later(self._sync_now)

    def sync(self) -> None:
        """Make the catalogue's pins exactly the named records, in one transaction."""
        if self.store is None:
            return
        try:
            self._sync_now()
        except CatalogBusy:
            self.store.catalog.later(self._sync_now)

    def _sync_now(self) -> None:
        self.store.catalog.replace_pins({n: (ns, token_key(t)) for n, (ns, t) in self.source().items()})
