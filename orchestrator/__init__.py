"""The public API: runs speculate → verify → correct across the draft and target pools.
Holds no session state of its own; handles and the pool registry live in Redis."""
