"""Cell output both generation magics share: text streamed as it arrives, a progress view
updated in place (the widget, or one text line), replaced by nothing when done."""

from __future__ import annotations

import sys
import time

from IPython.display import display

from mlxcache_kernel.widgets.progress import GenerationProgress, TextProgress


class DisplayLine:
    """A text stream for ``TextProgress`` that shows its current line in one
    output, updated in place (a carriage return starts the line over)."""

    def __init__(self):
        self.handle = display({"text/plain": ""}, raw=True, display_id=True)

    def write(self, text: str) -> None:
        self.handle.update({"text/plain": text.rsplit("\r", 1)[-1].rstrip()}, raw=True)

    def flush(self) -> None:
        pass


class Progress:
    """The engine's ``on_progress`` for one cell: a display created on the first
    unfinished update (the widget, or a TextProgress line where the widget
    cannot be shown), replaced by nothing at ``close()``.

    Only in a kernel (a front end that can update displays in place); a
    terminal IPython gets no progress display.
    """

    TEXT_THROTTLE_S = 0.25
    OPEN_TOKENS = 128  # a phase of fewer tokens is over before a bar would help

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.view = None  # GenerationProgress or TextProgress
        self.handle = None  # the display holding it

    def __call__(self, phase: str, done: int, total: int) -> None:
        if not self.enabled or (done >= total and total < self.OPEN_TOKENS):
            return  # a short phase over on arrival (a batch row's last token): what is shown stays
        if self.view is None:
            if done >= total or total < self.OPEN_TOKENS:  # finished, or too short to watch
                return
            self._open()  # at a long phase's first report (0 done): from the cell's first second
        self.view.update(phase, done, total)

    def _open(self) -> None:
        try:
            self.view = GenerationProgress()
            self.handle = display(self.view, display_id=True)
        except Exception:
            line = DisplayLine()
            self.view, self.handle = TextProgress(line, throttle_s=self.TEXT_THROTTLE_S), line.handle

    def close(self) -> None:
        if self.view is not None:
            try:
                self.view.finish()
                if isinstance(self.view, GenerationProgress):
                    self.view.close()
            except Exception:
                pass
            self.view = None
        if self.handle is not None:
            # Replace the output in place, so a saved notebook holds no dead widget view.
            self.handle.update({"text/plain": ""}, raw=True)
            self.handle = None


class Stream:
    """Writes generated text to the cell output as it arrives (main thread)."""

    def __init__(self):
        self.chars = 0
        self.last_char = "\n"
        self.last_flush = time.monotonic()

    def __call__(self, piece: str) -> None:
        if not piece:
            return
        out = sys.stdout
        out.write(piece)
        self.chars += len(piece)
        self.last_char = piece[-1]
        now = time.monotonic()
        if now - self.last_flush > 0.1:
            self.last_flush = now
            try:
                out.flush()
            except Exception:
                pass

    def end(self) -> None:
        if self.chars and self.last_char != "\n":
            sys.stdout.write("\n")
        try:
            sys.stdout.flush()
        except Exception:
            pass
