"""MLXCacheKernel: the IPython kernel with the mlxcache magics and one resident Engine.

- The magics are registered when the kernel starts; the Engine (and MLX) are
  created on first use, so the kernel starts as fast as a plain one.
- Between cells the kernel's event loop polls the engine once a second, so
  finished background writes are applied (and idle entries demoted) without
  waiting for the next cell. Everything MLX runs on the main thread.
- Shutdown and restart flush pending writes first, bounded by
  ``MLXCache.shutdown_flush_s`` (ipykernel gives a restarting kernel about 5 s
  before SIGKILL), and say what they did: a log line on the kernel's stderr
  and a stream message on IOPub. Files are written atomically, so whatever was
  not finished is simply recomputed next time; a committed checkpoint is never
  lost.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

from ipykernel.ipkernel import IPythonKernel

from . import __version__, load_ipython_extension

POLL_INTERVAL_MS = 1000
VERIFY_GAP_S = 0.002  # between two verification steps: the event loop takes a waiting cell first


class MLXCacheKernel(IPythonKernel):
    implementation = "mlxcache_kernel"
    implementation_version = __version__

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.mlxcache = load_ipython_extension(self.shell)
        # `%load_ext mlxcache_kernel` in this kernel is then a no-op.
        self.shell.extension_manager.loaded.add("mlxcache_kernel")
        self._poller = None
        self._verifying = False
        self.shutdown_report: dict | None = None

    @property
    def banner(self):
        return (
            f"MLX Cache kernel {__version__}: models and prompt caches stay resident across cells.\n"
            "Magics: %model, %%generate, %session, %checkpoint, %cache, %kv, %dashboard "
            "(append ? for help, e.g. %%generate?)\n\n" + (self.shell.banner if self.shell else "")
        )

    def start(self):
        super().start()
        try:
            from tornado.ioloop import PeriodicCallback

            self._poller = PeriodicCallback(self._poll, POLL_INTERVAL_MS)
            self._poller.start()
        except Exception:  # pragma: no cover - polling is an optimisation only
            self.log.debug("mlxcache: no periodic engine poll", exc_info=True)

    def _poll(self):
        self.mlxcache.poll()
        if not self._verifying:
            self._verify_more()

    def _verify_more(self):
        """Verify fetched remote states in short steps, each its own event-loop callback, so a cell's
        request that arrives meanwhile runs after the current step (~30 ms), not after all of them."""
        self._verifying = self.mlxcache.verify_step()
        if self._verifying:
            self.io_loop.call_later(VERIFY_GAP_S, self._verify_more)

    # --- shutdown ---

    def do_shutdown(self, restart):
        try:
            self.shutdown_report = self._flush_for_shutdown(restart)
        except Exception as e:  # never block a shutdown
            self.log.exception("mlxcache: flush at shutdown failed")
            self._say(f"[mlxcache] flush before {'restart' if restart else 'shutdown'} failed: {e}")
        if self._poller is not None and getattr(self, "io_loop", None) is not None:
            self.io_loop.add_callback(self._poller.stop)  # tornado objects belong to the main thread
        return super().do_shutdown(restart)

    def _flush_for_shutdown(self, restart: bool) -> dict | None:
        what = "restart" if restart else "shutdown"
        magics = self.mlxcache
        if not magics.engine_started:
            self.log.info("mlxcache: %s; the engine was never started, nothing to flush", what)
            return None
        timeout = float(magics.settings.shutdown_flush_s)
        t0 = time.perf_counter()
        report = self._flush_on_main_thread(timeout)
        if report is None:  # the main thread is busy (a cell is running): wait for queued writes only
            report = self._wait_for_writer(timeout - (time.perf_counter() - t0))
        seconds = time.perf_counter() - t0
        committed, pending = report.get("committed", 0), report.get("pending", 0)
        failed = len(report.get("failed") or [])
        where = magics.engine.cache_dir
        if pending or failed:
            msg = (
                f"[mlxcache] before {what}: {committed} writes committed in {seconds:.1f} s; "
                f"{pending} unfinished and {failed} failed (their states will be recomputed; "
                f"committed checkpoints in {where} are intact)"
            )
        elif committed:
            msg = f"[mlxcache] before {what}: flushed {committed} pending writes to {where} in {seconds:.1f} s"
        else:
            msg = f"[mlxcache] before {what}: nothing pending, every checkpoint is on disk in {where}"
        remote = report.get("remote_failed") or []
        if remote:  # already redacted; the wait was bounded by the same timeout
            msg += (f"; remote tier: {len(remote)} publication(s) failed or not finished "
                    f"({'; '.join(remote[:2])[:300]})")
        self._say(msg)
        return {**report, "seconds": seconds, "message": msg}

    def _flush_on_main_thread(self, timeout: float) -> dict | None:
        """Run engine.flush on the main (MLX owner) thread; None if it is busy."""
        if threading.current_thread() is threading.main_thread():
            return self.mlxcache.flush(timeout=timeout)
        started = threading.Event()
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run():
            if not future.set_running_or_notify_cancel():
                return
            started.set()
            try:
                future.set_result(self.mlxcache.flush(timeout=timeout))
            except BaseException as e:
                future.set_exception(e)

        loop = getattr(self, "io_loop", None)
        if loop is None:
            return None
        loop.add_callback(run)
        if not started.wait(0.5):
            future.cancel()
            if not started.is_set():
                return None
        return future.result(timeout + 1.0)

    def _wait_for_writer(self, timeout: float) -> dict:
        """Thread-safe fallback: wait for already queued writes, queue nothing new."""
        return {"failed": [], **self.mlxcache.engine.admin.wait_for_writes(timeout)}

    def _say(self, msg: str) -> None:
        """A visible line: the kernel log (stderr) and a stderr stream message on IOPub."""
        self.log.warning(msg)
        try:
            parent = self.get_parent("control") or self.get_parent("shell")
            self.session.send(
                self.iopub_socket,
                "stream",
                {"name": "stderr", "text": msg + "\n"},
                parent=parent,
                ident=self._topic("stream"),
            )
        except Exception:
            self.log.debug("mlxcache: could not send the shutdown message on IOPub", exc_info=True)
