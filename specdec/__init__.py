"""Shared core of the speculative-decoding server: sampling math, KV-cache runner,
wire encoding, Redis session store and registry, config and metrics.

It knows nothing of gRPC servicers; the services and the orchestrator import it.
"""
