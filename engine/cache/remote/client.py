"""The one door to the server: a lazily made redis-py client behind the breaker.

Every call goes through `GuardedClient.call`: the breaker decides whether
to call at all, and whatever the client raises becomes a RemoteError with
redacted text (built inside the handler, raised outside it, so no traceback
chains back to the client's own exception and its message).

Timeouts are short and retries few: a remote that does not answer promptly
is a miss (the breaker then stops asking), not a stalled generation. One
retry is kept so a pooled connection the server closed (idle timeout,
restart) is reopened once rather than failing the call. When the breaker
opens the client is dropped, so the retry after the cool-down starts from
a fresh connection (and, for a cluster, a fresh view of its nodes).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .breaker import Breaker
from .config import RemoteConfig, scrub

MAX_ERROR_CHARS = 300
log = logging.getLogger(__name__.rsplit(".", 1)[0])


class RemoteError(Exception):
    """A remote call failed; the message is redacted (no user, no password)."""


def connect(cfg: RemoteConfig, timeout_s: float, tls_ca_file: str | None = None):
    """A client for `cfg`. A cluster client contacts its startup nodes here (and may raise).

    TLS verifies the server's certificate and host name, against the system's
    CAs or `tls_ca_file` (a team's own CA)."""
    common = dict(username=cfg.username, password=cfg.password, socket_timeout=timeout_s,
                  socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 1))
    if cfg.tls:
        common.update(ssl=True, ssl_cert_reqs="required", ssl_check_hostname=True, ssl_ca_certs=tls_ca_file)
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


class GuardedClient:
    def __init__(self, cfg: RemoteConfig, timeout_s: float, breaker: Breaker, tls_ca_file: str | None = None):
        self.cfg, self.timeout_s, self.breaker, self.tls_ca_file = cfg, timeout_s, breaker, tls_ca_file
        self._lock = threading.Lock()  # the client reference and counters
        self._connect_lock = threading.Lock()  # one connection attempt at a time (it may take timeout_s)
        self._client = None
        self.errors = 0  # failed calls
        self.not_tried = 0  # calls the open breaker refused

    def call(self, what: str, fn: Callable):
        """fn(client), or RemoteError (redacted) if the breaker refuses or anything fails."""
        if not self.breaker.allow():
            with self._lock:
                self.not_tried += 1
            raise RemoteError(f"{what}: not tried, remote breaker {self.breaker.state()}")
        try:
            result = fn(self._client or self._connect())
        except Exception as e:  # noqa: BLE001 - whatever the client raises is a remote failure
            text = f"{what}: {describe(e, self.cfg)}"
        except BaseException:  # KeyboardInterrupt and kin: settle a half-open trial, then let it through
            self.breaker.failure(f"{what}: interrupted")
            raise
        else:
            self.breaker.success()
            return result
        with self._lock:
            self.errors += 1
        if self.breaker.failure(text):
            log.warning("remote %s: %s; breaker %s", self.cfg.redacted, text, self.breaker.state())
            self.close()
        raise RemoteError(text)

    def pipeline(self, what: str, fill: Callable) -> list:
        """Run the commands `fill(pipe)` queues in one non-transactional pipeline (split by node in a cluster)."""
        def run(client):
            pipe = client.pipeline(transaction=False)
            fill(pipe)
            return pipe.execute()

        return self.call(what, run)

    def _connect(self):
        with self._connect_lock:
            client = self._client
            if client is None:
                client = connect(self.cfg, self.timeout_s, self.tls_ca_file)
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
