"""Starting and stopping the tests' local stacks."""
from __future__ import annotations

import shutil
import warnings

from localstack.stack import LocalStack


def started_stack(make=LocalStack, **counts) -> LocalStack:
    """`make()` started with `counts` (drafts=, targets=); one that does not come up (the
    machine, not the code: a port taken between choosing and binding it, a disk that
    refuses Redis's AOF) is reported as a warning with its diagnostics and started once
    more, on fresh ports. A second failure fails the tests."""
    stack = make()
    try:
        return stack.start(**counts)
    except (TimeoutError, RuntimeError) as exc:
        warnings.warn(f"the stack did not come up, starting it again: {exc}")
        shutil.rmtree(stack.workdir, ignore_errors=True)
    return make().start(**counts)


def stopped(stack: LocalStack) -> None:
    stack.stop()
    shutil.rmtree(stack.workdir, ignore_errors=True)
