"""Start and stop a local stack of real processes on loopback ports."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from localstack.leash import leashed
from specdec.model_files import BUNDLED_DRAFT, BUNDLED_TARGET, REPO_ROOT


STOP_WAIT_S = 15.0  # how long `LocalStack.stop` waits for a server to exit after SIGTERM


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape_metrics(port: int) -> dict[str, float]:
    """A process's Prometheus samples from its /metrics endpoint on loopback, keyed by the
    sample's name with its labels as printed (`name{label="x"}`)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def redis_server_binary() -> str:
    path = os.environ.get("SPECDEC_REDIS_SERVER") or shutil.which("redis-server")
    if not path:
        raise RuntimeError("redis-server not found: install it (apt-get install -y redis-server) "
                           "or set SPECDEC_REDIS_SERVER")
    return path


def wait_serving(address: str, timeout: float = 60.0, proc: subprocess.Popen | None = None,
                 credentials=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for {address} exited with code {proc.returncode}")
        channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            if resp.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        finally:
            channel.close()
        time.sleep(0.2)
    raise TimeoutError(f"{address} did not report SERVING within {timeout:.0f}s")


@dataclass(frozen=True)
class Variant:
    """A replica's own settings beside the stack's: environment, flags, and how a report
    names it ("": the pool's plain replicas)."""
    env: dict = field(default_factory=dict)
    args: list = field(default_factory=list)
    label: str = ""


@dataclass
class Replica:
    kind: str
    port: int
    proc: subprocess.Popen
    label: str = ""  # how a report tells it from its pool's others (a soak's target variants)
    metrics_port: int = 0  # its /metrics on loopback, where one was asked for

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class LocalStack:
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="specdec-stack-")))
    draft_model: str = str(BUNDLED_DRAFT)
    target_model: str = str(BUNDLED_TARGET)
    threads: int = 1
    # the replicas' --dtype, by pool ("draft", "target"); a pool not named takes its default
    dtypes: dict = field(default_factory=dict)
    draft_args: list = field(default_factory=list)  # more flags for every draft replica (e.g. --quantize)
    redis_password: str | None = None
    quiet: bool = True
    extra_env: dict = field(default_factory=dict)
    redis_port: int = 0
    # channel credentials for the health checks when the servers run TLS (mutual TLS:
    # include a client certificate the replicas trust)
    health_credentials: grpc.ChannelCredentials | None = None
    start_timeout: float = 300.0  # seconds for a server to report SERVING (slow on a busy machine)
    redis_proc: subprocess.Popen | None = None
    replicas: list[Replica] = field(default_factory=list)
    orchestrators: list[Replica] = field(default_factory=list)

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    @property
    def orchestrator_address(self) -> str:
        return self.orchestrators[0].address

    def _env(self) -> dict:
        env = dict(os.environ, PYTHONUNBUFFERED="1", SPECDEC_REDIS_URL=self.redis_url,
                   PYTHONPATH=str(REPO_ROOT), **self.extra_env)
        if self.redis_password:
            pw = self.workdir / "redis-password"
            pw.write_text(self.redis_password)
            env["SPECDEC_REDIS_PASSWORD_FILE"] = str(pw)
        return env

    def _spawn(self, args: list[str], name: str, env: dict | None = None) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")
        out = log if self.quiet else None
        # leashed: it ends with this process (localstack/leash.py)
        return subprocess.Popen(leashed(args), cwd=REPO_ROOT, env={**self._env(), **(env or {})}, stdout=out,
                                stderr=subprocess.STDOUT if out else None, start_new_session=True)

    def start_redis(self, port: int = 0) -> None:
        """The stack's own redis-server (append-only file in the stack's directory, no RDB
        snapshots), waited for up to 10 s; what stops it is said with the tail of its log."""
        self.redis_port = port or self.redis_port or free_port()
        args = [redis_server_binary(), "--port", str(self.redis_port), "--bind", "127.0.0.1",
                "--dir", str(self.workdir), "--appendonly", "yes", "--appendfsync", "everysec",
                "--save", "", "--daemonize", "no"]
        if self.redis_password:
            args += ["--requirepass", self.redis_password]
        self.redis_proc = self._spawn(args, "redis")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.redis_proc.poll() is not None:
                raise RuntimeError(f"redis-server exited at start (status {self.redis_proc.returncode}); "
                                   f"is port {self.redis_port} taken?{self._redis_log()}")
            try:
                with socket.create_connection(("127.0.0.1", self.redis_port), timeout=0.2):
                    break
            except OSError:
                time.sleep(0.05)
        else:
            raise RuntimeError(f"redis-server did not start within 10 s{self._redis_log()}")
        self._check_redis_is_ours()

    def _check_redis_is_ours(self) -> None:
        """The server answering on the port is the redis-server just started, not one that
        held the port already (a developer's own Redis on 6379): the stack would otherwise
        register its replicas and sessions there while its own server exits on the taken
        port."""
        import redis

        try:
            pid = redis.Redis(port=self.redis_port, password=self.redis_password,
                              socket_timeout=5).info("server")["process_id"]
        except redis.RedisError as exc:
            pid, why = None, f" ({exc})"
        else:
            why = f" (its process id {pid})"
        if pid != self.redis_proc.pid:
            raise RuntimeError(f"port {self.redis_port} is served by another Redis{why}, not the stack's "
                               f"redis-server: choose a free port (python -m localstack run --redis-port N)")

    def _redis_log(self, lines: int = 5) -> str:
        """The end of the stack's redis-server log, indented under an error's line."""
        return "".join(f"\n  {line}" for line in _tail(self.workdir / "redis.log", lines))

    def stop_redis(self) -> None:
        if self.redis_proc:
            self.redis_proc.terminate()
            self.redis_proc.wait(10)
            self.redis_proc = None

    def start_replica(self, kind: str, port: int = 0, wait: bool = True, extra: list[str] = (),
                      env: dict | None = None, label: str = "", metrics: bool = False) -> Replica:
        """One replica; `env` adds to the stack's environment for it alone, `metrics` serves
        its /metrics on a free loopback port (`Replica.metrics_port`)."""
        port = port or free_port()
        metrics_port = free_port() if metrics else 0
        model = self.draft_model if kind == "draft" else self.target_model
        args = [sys.executable, "-m", f"{kind}_service", "--port", str(port), "--host", "127.0.0.1",
                "--model", model, "--threads", str(self.threads), "--drain-seconds", "2",
                *(["--dtype", self.dtypes[kind]] if kind in self.dtypes else []),
                *(self.draft_args if kind == "draft" else []),
                *(["--metrics-port", str(metrics_port)] if metrics_port else []), *extra]
        rep = Replica(kind, port, self._spawn(args, f"{kind}-{port}", env), label, metrics_port)
        self.replicas.append(rep)
        if wait:
            self.wait_serving(rep)
        return rep

    def start_orchestrator(self, port: int = 0, wait: bool = True, extra: list[str] = ()) -> Replica:
        port = port or free_port()
        args = [sys.executable, "-m", "orchestrator", "--port", str(port), "--host", "127.0.0.1",
                "--tokenizer", self.target_model, "--drain-seconds", "5", *extra]
        rep = Replica("orchestrator", port, self._spawn(args, f"orchestrator-{port}"))
        self.orchestrators.append(rep)
        if wait:
            self.wait_serving(rep)
        return rep

    def wait_serving(self, rep: Replica) -> None:
        """Until `rep` reports SERVING. Apart from the start, so that a caller on an event
        loop starts a server from the loop's thread (where `leashed` can tie it to this
        process) and waits for it on a worker thread."""
        wait_serving(rep.address, proc=rep.proc, timeout=self.start_timeout, credentials=self.health_credentials)

    def wait_registered(self, drafts: int, targets: int, timeout: float = 30.0) -> None:
        import redis

        client = redis.Redis(port=self.redis_port, password=self.redis_password)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            d = len(client.keys("specdec:replica:draft:*"))
            t = len(client.keys("specdec:replica:target*:*"))  # and pools named target-...
            if d >= drafts and t >= targets:
                return
            time.sleep(0.1)
        raise TimeoutError(f"replicas did not register in Redis ({drafts} draft, {targets} target expected, "
                           f"{d} and {t} registered)\n{self.diagnostics(client)}")

    def diagnostics(self, client=None, lines: int = 12) -> str:
        """What a stack that did not come up, or failed a test, shows: whether Redis takes
        writes (an AOF it cannot write refuses them while reads go on) and the last `lines`
        lines of each server's log."""
        import redis

        client = client or redis.Redis(port=self.redis_port, password=self.redis_password)
        out = []
        try:
            info = client.info("persistence")
            out.append("redis: aof_last_write_status=%s aof_last_bgrewrite_status=%s"
                         % (info.get("aof_last_write_status"), info.get("aof_last_bgrewrite_status")))
            client.set("specdec:stack:probe", "1", px=1000)
        except redis.RedisError as exc:
            out.append(f"redis: {exc}")
        for rep in self.replicas + self.orchestrators:
            tail = self.log_tail(rep, lines) or ["(no log)"]
            state = "running" if rep.proc.poll() is None else f"exited {rep.proc.returncode}"
            out += [f"--- {rep.kind} on {rep.port} ({state}):", *tail]
        return "\n".join(out)

    def wait_all(self, drafts: int, targets: int) -> None:
        """Every process started with wait=False serving, and the replicas registered. An
        orchestrator needs no replica to start, so starting all of them before waiting loads
        the models and the tokenizer together: 5.5 s for a stack here instead of 8."""
        for rep in self.replicas + self.orchestrators:
            self.wait_serving(rep)
        self.wait_registered(drafts, targets)

    def start(self, drafts: int = 1, targets: int = 1, orchestrators: int = 1,
              target_variants: list[Variant] = (), metrics: bool = False) -> "LocalStack":
        """Redis, the replicas and the orchestrators; on any failure everything started is
        stopped again, so no process outlives a stack that did not come up. With
        `target_variants`, one target replica each, started with it, in place of `targets`
        plain ones; `metrics`: every replica serves its /metrics."""
        variants = list(target_variants) or [Variant()] * targets
        try:
            self.start_redis()
            for v in variants:
                self.start_replica("target", wait=False, extra=v.args, env=v.env, label=v.label, metrics=metrics)
            for _ in range(drafts):
                self.start_replica("draft", wait=False, metrics=metrics)
            for _ in range(orchestrators):
                self.start_orchestrator(wait=False)
            self.wait_all(drafts, len(variants))
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self, rep: Replica, sig: int = signal.SIGKILL) -> None:
        rep.proc.send_signal(sig)
        rep.proc.wait(30)

    def stop(self) -> None:
        for rep in self.orchestrators + self.replicas:
            if rep.proc.poll() is None:
                rep.proc.terminate()
        for rep in self.orchestrators + self.replicas:
            try:
                rep.proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                rep.proc.kill()
                rep.proc.wait(10)
                self._report_kill(rep)
        self.stop_redis()

    def _report_kill(self, rep: Replica, lines: int = 40) -> None:
        """A server that had to be killed says so, with the end of its log: a stop that
        hangs writes there where it hangs (specdec/grpc_server.watch_stop)."""
        print(f"localstack: {rep.kind} {rep.address} did not exit within {STOP_WAIT_S:.0f}s of SIGTERM and was "
              f"killed; the end of its log ({self.log_path(rep)}):", *self.log_tail(rep, lines), sep="\n",
              file=sys.stderr)

    def log_path(self, rep: Replica) -> Path:
        """Where a server's output goes while the stack is quiet (`_spawn`)."""
        return self.workdir / f"{rep.kind}-{rep.port}.log"

    def log_tail(self, rep: Replica, lines: int) -> list[str]:
        """The last lines of a server's log; none where it has no log."""
        return _tail(self.log_path(rep), lines)

    def __enter__(self) -> "LocalStack":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _tail(path: Path, lines: int) -> list[str]:
    """The last `lines` lines of a log file; none where there is no such file."""
    return path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []
