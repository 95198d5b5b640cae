"""Shared fixtures: the bundled models, a real redis-server, real local stacks."""
from __future__ import annotations

import shutil
import subprocess
import tempfile
import time

import pytest
import torch

from localstack.leash import leashed
from localstack.stack import free_port, redis_server_binary
from specdec.models import BUNDLED_DRAFT, BUNDLED_TARGET
from tests.stacks import started_stack, stopped

torch.set_num_threads(1)  # the servers under test share this machine's cores


@pytest.fixture(scope="session", autouse=True)
def native_kernels():
    """specdec's CPU kernels compiled (make setup does it) or loaded before any server
    starts, so that no replica's start waits for the compiler."""
    from specdec import native

    return native.module()


@pytest.fixture(scope="session")
def bundled_paths():
    assert (BUNDLED_TARGET / "model.safetensors").exists(), "bundled models missing: run `make models`"
    return BUNDLED_DRAFT, BUNDLED_TARGET


@pytest.fixture(scope="session")
def target_model(bundled_paths):
    from specdec.models import load_model

    return load_model(bundled_paths[1], torch.device("cpu"), torch.float32)


@pytest.fixture(scope="session")
def draft_model(bundled_paths):
    from specdec.models import load_model

    return load_model(bundled_paths[0], torch.device("cpu"), torch.float32)


@pytest.fixture(scope="session")
def tokenizer(bundled_paths):
    from specdec.models import load_tokenizer

    return load_tokenizer(bundled_paths[1])


@pytest.fixture(scope="session")
def heldout_prompts():
    from training.corpus import heldout_prompts

    return heldout_prompts(20)


class RedisServer:
    def __init__(self, password: str | None = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="specdec-redis-")
        self.port = free_port()
        self.password = password
        self.proc = None

    def start(self) -> "RedisServer":
        args = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
                "--appendonly", "yes", "--save", ""]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(leashed(args), stdout=subprocess.DEVNULL)
        import redis

        client = redis.Redis(port=self.port, password=self.password)
        for _ in range(100):
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


@pytest.fixture
def redis_server():
    server = RedisServer().start()
    yield server
    server.stop()
    shutil.rmtree(server.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def local_stack(bundled_paths):
    """One draft, one target, one orchestrator and Redis, shared by the e2e tests."""
    stack = started_stack()
    yield stack
    stopped(stack)


@pytest.fixture(scope="module")
def stack(bundled_paths):
    """A stack of a module's own, for tests that disturb it (kills, restarts, caps)."""
    stack = started_stack()
    yield stack
    stopped(stack)
