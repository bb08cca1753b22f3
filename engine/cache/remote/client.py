"""The one door to the server: a lazily made redis-py client behind the breaker, with deadlines.

Every call goes through `GuardedClient.call`: the breaker decides whether
to call at all, and whatever the client raises becomes a RemoteError with
redacted text (built inside the handler, raised outside it, so no traceback
chains back to the client's own exception and its message).

A socket timeout bounds each wait for a byte, not a call: a server that
drips one byte a second never times out. So a call may carry a deadline:
past it, the watchdog thread cuts the client's connections (redis-py's
documented way to disconnect connections in use by other threads), the
blocked read returns, and the call fails as "past its deadline": a stall
(as is a socket timeout: a paused server),
which opens the breaker at once (a paused or dripping server would cost
every lookup its whole deadline). Pipelines run with raise_on_error=False:
a command refused by the server (a wrong type planted at a key, an ACL
that denies a write) is a value the caller judges, not a broken server.

Timeouts are short and retries few: one retry reopens a pooled connection
the server closed (idle timeout, restart). When the breaker opens the
client is dropped, so the retry after the cool-down starts from a fresh
connection (and, for a cluster, a fresh view of its nodes).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable

import redis
from redis.backoff import NoBackoff
from redis.exceptions import AskError, ClusterError, ResponseError, TryAgainError
from redis.retry import Retry

from .breaker import Breaker
from .config import RemoteConfig, scrub
from ...errors import RemoteError  # noqa: F401 (raised here; defined in errors.py)

MAX_ERROR_CHARS = 300
RECUT_S = 0.05  # after a deadline, cut again this often until the call returns (redis-py retries once)
log = logging.getLogger(__name__.rsplit(".", 1)[0])



def connect(cfg: RemoteConfig, timeout_s: float, tls: dict | None = None):
    """A client for `cfg`. A cluster client contacts its startup nodes here (and may raise).

    TLS verifies the server's certificate and host name, against the system's
    CAs or tls["ca_file"] (a team's own CA); tls["cert_file"] and
    tls["key_file"] present a client certificate to a server that asks."""
    common = dict(username=cfg.username, password=cfg.password, socket_timeout=timeout_s,
                  socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 1))
    if cfg.tls:
        tls = tls or {}
        common.update(ssl=True, ssl_cert_reqs="required", ssl_check_hostname=True, ssl_ca_certs=tls.get("ca_file"),
                      ssl_certfile=tls.get("cert_file"), ssl_keyfile=tls.get("key_file"))
    if cfg.cluster:
        from redis.cluster import ClusterNode, RedisCluster

        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in cfg.nodes], **common)
    (host, port), = cfg.nodes
    return redis.Redis(host=host, port=port, db=cfg.db, **common)


def describe(exc: BaseException, cfg: RemoteConfig) -> str:
    """`Type: message` of an exception with the config's secrets removed, cut to a readable length.

    redis-py messages name hosts and ports, not credentials, but a server's
    reply or a future client version might echo them: scrub regardless."""
    text = scrub(f"{type(exc).__name__}: {exc}", cfg.secrets())
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "..."


def _answer(reply: Exception) -> bool:
    """Is this error the server's answer to one command (not a node or cluster that is down)?"""
    return isinstance(reply, ResponseError) and not isinstance(reply, (ClusterError, AskError, TryAgainError))


def _cut(client) -> None:
    """Disconnect every connection of `client`, those in use by other threads included."""
    try:
        if hasattr(client, "disconnect_connection_pools"):  # a cluster: every node's pool
            client.disconnect_connection_pools()
        else:
            client.connection_pool.disconnect(inuse_connections=True)
    except Exception:  # noqa: BLE001 - a connection that cannot even be closed is gone either way
        pass


class Watchdog:
    """One daemon thread for the process: at a guarded call's deadline it runs the call's `cut`."""

    def __init__(self):
        self._cond = threading.Condition()
        self._calls: dict[int, list] = {}  # id -> [due (monotonic), cut, fired]
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def guard(self, seconds: float, cut: Callable[[], None]):
        entry = [time.monotonic() + seconds, cut, False]
        with self._cond:
            self._calls[id(entry)] = entry
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="mlxcache-remote-deadlines", daemon=True)
                self._thread.start()
            self._cond.notify()
        try:
            yield entry
        finally:
            with self._cond:
                self._calls.pop(id(entry), None)

    def _loop(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                due = [e for e in self._calls.values() if e[0] <= now]
                for e in due:
                    e[0], e[2] = now + RECUT_S, True
                if not due:
                    nxt = min((e[0] for e in self._calls.values()), default=None)
                    self._cond.wait(None if nxt is None else nxt - now)
                    continue
            for e in due:
                e[1]()


WATCHDOG = Watchdog()


class GuardedClient:
    def __init__(self, cfg: RemoteConfig, timeout_s: float, breaker: Breaker, tls: dict | None = None):
        self.cfg, self.timeout_s, self.breaker, self.tls = cfg, timeout_s, breaker, tls
        self._lock = threading.Lock()  # the client reference and counters
        self._connect_lock = threading.Lock()  # one connection attempt at a time (it may take timeout_s)
        self._client = None
        self.errors = 0  # failed calls
        self.not_tried = 0  # calls the open breaker refused
        self.deadlines_missed = 0  # calls cut at their deadline

    def call(self, what: str, fn: Callable, deadline_s: float | None = None):
        """fn(client), or RemoteError (redacted) if the breaker refuses, anything fails or the deadline passes."""
        if not self.breaker.allow():
            with self._lock:
                self.not_tried += 1
            raise RemoteError(f"{what}: not tried, remote breaker {self.breaker.state()}")
        guard = [0.0, None, deadline_s is not None and deadline_s <= 0]  # [due, cut, fired]
        try:
            if guard[2]:
                raise TimeoutError("no time left")
            client = self._client or self._connect()
            if deadline_s is None:
                result = fn(client)
            else:
                with WATCHDOG.guard(deadline_s, lambda: _cut(client)) as guard:
                    result = fn(client)  # a complete answer, even one that beat a cut by a hair, is good
        except Exception as e:  # noqa: BLE001 - whatever the client raises is a remote failure
            text = (f"{what}: no complete answer within its deadline of {deadline_s:.3g} s (slow or dripping "
                    "server)" if guard[2] else f"{what}: {describe(e, self.cfg)}")
            stalled = guard[2] or isinstance(e, (redis.exceptions.TimeoutError, TimeoutError))  # a paused server
        except BaseException:  # KeyboardInterrupt and kin: settle a half-open trial, then let it through
            self.breaker.failure(f"{what}: interrupted")
            raise
        else:
            self.breaker.success()
            return result
        with self._lock:
            self.errors += 1
            self.deadlines_missed += stalled
        if self.breaker.failure(text, trip=stalled):  # a stall costs a cell its deadline: not again soon
            log.warning("remote %s: %s; breaker %s", self.cfg.redacted, text, self.breaker.state())
            self.close()
        raise RemoteError(text)

    def pipeline(self, what: str, fill: Callable, deadline_s: float | None = None) -> list:
        """Run the commands `fill(pipe)` queues in one non-transactional pipeline (split by node in a
        cluster). A command the server refused is its exception object in the result list."""
        def run(client):
            pipe = client.pipeline(transaction=False)
            fill(pipe)
            replies = pipe.execute(raise_on_error=False)
            broken = next((r for r in replies if isinstance(r, Exception) and not _answer(r)), None)
            if broken is not None:  # a node that did not answer (a cluster reports it per command)
                raise broken
            return replies

        return self.call(what, run, deadline_s)

    def _connect(self):
        with self._connect_lock:
            client = self._client
            if client is None:
                client = connect(self.cfg, self.timeout_s, self.tls)
                with self._lock:
                    self._client = client
            return client

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing a broken connection may fail too; it is gone either way
                pass
