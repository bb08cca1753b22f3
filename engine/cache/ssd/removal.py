"""What a catalogue transaction decided to remove, done once it committed.

Rows go first: a transaction drops the rows of files and blocks (blocks move
to `freeing`, so no one writes them again meanwhile) and records here what
goes; after COMMIT, `run()` unlinks or quarantines the manifests no row
points at again, then does the blocks' part under a fence, fsyncs the
directories of renames, ends the blocks' `freeing` and only then reports
(stats and events). Directories that only lost files are fsynced by the
keeper within a second (a deletion a crash undoes is found again by
reconcile or gc; the writer need not wait for it). A kill before `run()`
leaves files without rows: the next reconcile or gc removes them (or finds
them bad again), and the survivors' sweep finishes the freeing of a dead
process.

The fence: block names are reused (the same KV is the same block), so a
process that was paused after its COMMIT (SIGSTOP, a debugger, `docker
pause`) and swept as dead meanwhile must not unlink or move a block a peer
has taken over and perhaps written again. Each block is unlinked or moved
inside a short transaction (FENCE_CHUNK blocks) that first re-checks that its
`freeing` mark is still this process's and that no row records it; a sweep
needs the write lock, so no one takes the mark over between that check and
the unlink. A mark taken over means: do nothing destructive, the peer did it.
Manifests are never reused by name: one is removed unless a row points at it
again (a reconcile indexed it meanwhile).

A failure on the way (a fsync, the unfree COMMIT on a full or failing disk)
never strands this process's own marks: `unfree` is retried by the keeper
until it succeeds (a mark left would make this process's next write of those
blocks wait for itself).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ...host import safe_dirs
from ...host.system import fsync_dir
from ..catalog.database import CatalogBusy
from ..faults import fault
from . import blocks

from .store_side import RemovalSide

FENCE_CHUNK = 16  # blocks unlinked or moved per fencing transaction (about 1 ms an unlink on a busy disk)


class AfterCommit:
    def __init__(self, store: RemovalSide, label: str):
        self.store, self.label = store, label
        self.files: list[Path] = []  # unlink
        self.blocks: list[tuple[str, int]] = []  # (name, bytes) freed: unlink, then unfree
        self.dirs: set[Path] = set()  # fsync now (renames into them)
        self.moves: list[tuple[Path, Path, str]] = []  # (bad file, into quarantine, why)
        self.events: list[dict] = []
        self.evicted = 0

    def run(self) -> None:
        store = self.store
        names = sorted({n for n, _ in self.blocks})
        block_moves = {Path(p).stem: (p, d, r) for p, d, r in self.moves if Path(p).parent == store.blocks_root}
        file_moves = [m for m in self.moves if Path(m[0]).parent != store.blocks_root]
        fenced = sorted(set(names) | set(block_moves))
        chunks = [fenced[i : i + FENCE_CHUNK] for i in range(0, len(fenced), FENCE_CHUNK)]
        try:
            indexed = store.catalog.indexed([Path(p) for p, _, _ in file_moves] + self.files)
            for path, dest, reason in file_moves:
                if Path(path) not in indexed:
                    self._move(path, dest, reason)
            fault(f"{self.label}.unlink")
            safe_dirs.unlink_all([local(store, p) for p in self.files if Path(p) not in indexed], store.anchor)
            self._finish(chunks, block_moves, names)
        except Exception:
            if not chunks:
                raise
            store.catalog.later(lambda: self._again(chunks, block_moves, names))  # the fence did not come
            for d in sorted(self.dirs):  # what was renamed so far (a commit's manifest) is durable before we return
                fsync_dir(d)
        with store._lock:
            store._stats["blocks_freed"] += len(self.blocks)
            store._stats["evicted"] += self.evicted
        for event in self.events:
            store._emit(event)

    def _finish(self, chunks: list, block_moves: dict, names: list[str]) -> None:
        """The blocks' part (chunks are popped as they are done), the fsyncs, then `unfree`."""
        store = self.store
        while chunks:
            self._fenced(chunks[0], block_moves)
            chunks.pop(0)
        fault(f"{self.label}.unlinked")
        try:
            for d in sorted(self.dirs):
                fsync_dir(d)
            emptied = {Path(p).parent for p in self.files} | ({store.blocks_root} if self.blocks else set())
            store.fsync_later(emptied - self.dirs)
        finally:
            if names:
                unfree(store, names)

    def _again(self, chunks: list, block_moves: dict, names: list[str]) -> None:
        """The keeper's retry of a fence that did not come (busy, a failing disk): next turn again."""
        try:
            self._finish(chunks, block_moves, names)
        except CatalogBusy:
            raise
        except Exception as exc:
            raise CatalogBusy(f"finishing {self.label} failed: {exc}") from exc

    def _fenced(self, chunk: list[str], block_moves: dict) -> None:
        """Unlink or move the blocks of `chunk` whose `freeing` mark is still ours, inside one
        transaction (a sweep cannot take a mark over meanwhile: it needs the write lock)."""
        store = self.store
        with store.catalog.transaction("fence") as db:
            mine = store.catalog.own_freeing(db, chunk)
            for name in chunk:
                if name not in mine:
                    continue  # taken over (we were swept as dead): the peer did it, and may have written it again
                if name in block_moves:
                    self._move(*block_moves[name])
                safe_dirs.unlink(blocks.block_path(store.blocks_root, name), store.anchor)

    def _move(self, path: Path, dest: Path, reason: str) -> None:
        fault(f"{self.label}.rename")
        try:
            safe_dirs.replace(local(self.store, path), dest, self.store.anchor)
        except FileNotFoundError:
            return  # another process moved or removed it first
        except OSError as exc:
            self.events.append({"type": "quarantine_failed", "path": str(path), "reason": reason, "error": str(exc)})
            return
        self.dirs |= {Path(path).parent, Path(dest).parent}
        self.store._report_quarantine(path, reason)


def local(store: RemovalSide, path) -> Path:
    """A catalogued file's path under this process's root: a row names it as its writer spelled
    the root, perhaps through a link to the same directory; files lie at <root>/<dir>/<name>."""
    p = Path(path)
    return store.root / p.parent.name / p.name


def unfree(store: RemovalSide, names: list[str]) -> None:
    """End our `freeing` marks of `names`; on any failure (busy, a full or failing disk) the
    keeper retries until it succeeds. Never raises."""
    try:
        store.catalog.unfree(names)
    except Exception:
        def retry() -> None:
            try:
                store.catalog.unfree(names)
            except Exception as exc:  # the keeper puts it back for its next turn
                raise CatalogBusy(f"ending freeing marks failed: {exc}") from exc
        store.catalog.later(retry)


@contextmanager
def changing(store: RemovalSide, label: str, wait: float | None = None) -> Iterator[tuple]:
    """`with changing(store, "gc") as (db, after):` a transaction whose removals run after its COMMIT."""
    after = AfterCommit(store, label)
    with store.catalog.transaction(label, wait) as db:
        yield db, after
    after.run()
