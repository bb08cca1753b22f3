"""A real kernel process plus client for tests, with helpers that read cell outputs."""

from __future__ import annotations

import os
import queue
import re
import signal
import time
from pathlib import Path


class Kernel:
    """One kernel process and a client, with helpers that collect a cell's outputs."""

    def __init__(self, spec_prefix: Path, env: dict, log: Path):
        from jupyter_client.kernelspec import KernelSpecManager
        from jupyter_client.manager import KernelManager

        ksm = KernelSpecManager(kernel_dirs=[str(spec_prefix / "share" / "jupyter" / "kernels")])
        self.km = KernelManager(kernel_name="mlxcache", kernel_spec_manager=ksm)
        self.env = env
        self.log = log
        self._log_file = open(log, "ab")
        self.km.start_kernel(env=env, stderr=self._log_file)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def execute(self, code: str, timeout: float = 300) -> dict:
        outs: list[str] = []
        result = {"stream": "", "stderr": "", "results": [], "error": None}

        def hook(msg):
            t, c = msg["msg_type"], msg["content"]
            if t == "stream":
                result["stream" if c["name"] == "stdout" else "stderr"] += c["text"]
                outs.append(c["text"])
            elif t in ("execute_result", "display_data"):
                text = c["data"].get("text/plain", "")
                if t == "execute_result":
                    result["results"].append(text)
                outs.append(text)
            elif t == "error":
                result["error"] = (c["ename"], c["evalue"])

        reply = self.kc.execute_interactive(code, output_hook=hook, timeout=timeout)
        result["status"] = reply["content"]["status"]
        if result["status"] == "error" and result["error"] is None:  # a UsageError prints, no error message
            result["error"] = (reply["content"].get("ename"), reply["content"].get("evalue"))
        result["text"] = "".join(outs)
        return result

    def interrupt(self, msg_id: str) -> dict:
        """Interrupt the cell sent as `msg_id`; its reply's content, once the kernel runs requests
        again. After an error, ipykernel aborts (never runs) the requests that reach it until its
        "stop aborting" message comes through: one sent right after the reply may be aborted, the
        busier the machine the likelier. So a no-op is sent until one runs."""
        self.km.interrupt_kernel()
        reply = self.kc.get_shell_msg(timeout=60)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = self.kc.get_shell_msg(timeout=60)
        for _ in range(1000):
            if self.execute("pass")["status"] != "aborted":
                return reply["content"]
        raise AssertionError("the kernel aborted 1000 requests after the interrupt")

    def cell_ended(self, msg_id: str) -> str | None:
        """None while the cell sent as `msg_id` runs (or the kernel lives); else how it ended.
        Consumes shell replies: call it only while that cell is the one awaiting a reply."""
        if not self.km.is_alive():
            return "the kernel died"
        try:
            reply = self.kc.get_shell_msg(timeout=0.01)
        except queue.Empty:
            return None
        if reply["parent_header"].get("msg_id") != msg_id:
            return None
        return f"the cell ended: {reply['content']['status']} {reply['content'].get('ename', '')}"

    def drain_iopub(self, seconds: float = 1.0) -> list[dict]:
        msgs, deadline = [], time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                msgs.append(self.kc.get_iopub_msg(timeout=0.2))
            except Exception:
                pass
        return msgs

    def restart(self) -> list[dict]:
        """Restart; returns the IOPub messages seen meanwhile (wait_for_ready would drop them)."""
        self.km.restart_kernel(now=False)
        msgs = self.drain_iopub(0.5)
        self.kc.wait_for_ready(timeout=120)
        return msgs

    def shutdown(self):
        try:
            self.kc.stop_channels()
            if self.km.has_kernel:
                self.km.shutdown_kernel(now=False)
        finally:
            self._log_file.close()

    @property
    def pid(self) -> int:
        return self.km.provisioner.process.pid

    def kill9(self) -> None:
        """SIGKILL the kernel process (no shutdown, no atexit) and wait for it to die."""
        os.kill(self.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while self.km.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not self.km.is_alive()


def footer(res: dict) -> str:
    lines = [r for r in res["results"] if r.startswith("[mlxcache]")]
    assert lines, res
    return lines[-1]


def counts(f: str) -> dict:
    """prompt/ram/ssd/prefilled token counts from a footer line."""
    m = re.search(r"(\d+) prompt tokens: (\d+) from RAM, (\d+) from SSD, (\d+) prefilled", f)
    assert m, f
    return dict(zip(("prompt", "ram", "ssd", "prefilled"), map(int, m.groups())))


def generated_text(res: dict) -> str:
    """The streamed text: stdout minus the model-loading line."""
    return "\n".join(ln for ln in res["stream"].splitlines() if not ln.startswith("[mlxcache]"))


def inflight_progress(cache_dir: Path) -> int:
    """Tokens emitted by the newest in-flight resume record under a cache directory."""
    from catalog_view import inflight_records

    return max((len(r.get("emitted", [])) for r in inflight_records(cache_dir)), default=0)
