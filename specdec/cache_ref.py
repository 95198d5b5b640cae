"""Which cache a call means: a session's id, the epoch its handle holds, and the tokens it
sends from `start` on. Torch-free: the orchestrator builds these, the replicas' session
tables (specdec/sessions.py) check them against what they hold.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CacheRef:
    session_id: str
    epoch: int
    start: int
    tokens: list[int]
    resync: bool = False
