"""The local stack launcher: a stack that does not come up says why."""
from __future__ import annotations

import shutil

import pytest
import redis

from localstack.stack import LocalStack

pytestmark = pytest.mark.e2e


def test_a_replica_that_cannot_register_is_reported_with_redis_state_and_its_log(bundled_paths):
    """Redis that serves reads but refuses writes (here: it asks for a replica it does not
    have; a full disk under its AOF does the same) keeps every replica out of the pool.
    The launcher's error names the refusal and shows the replica's own warning."""
    stack = LocalStack()
    try:
        stack.start_redis()
        redis.Redis(port=stack.redis_port).config_set("min-replicas-to-write", 1)
        stack.start_replica("draft")
        with pytest.raises(TimeoutError) as err:
            stack.wait_registered(drafts=1, targets=0, timeout=3.0)
    finally:
        stack.stop()
        shutil.rmtree(stack.workdir, ignore_errors=True)
    message = str(err.value)
    assert "0 and 0 registered" in message
    assert "NOREPLICAS" in message, "the diagnostics should show that Redis refuses writes"
    assert "registry: cannot register in Redis" in message, "the replica's log tail should be in the error"
    assert "--- draft on" in message and "(running)" in message
