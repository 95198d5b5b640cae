"""The whole stack on one machine (Redis, draft and target replicas, orchestrator) as
child processes: used by `make run`, `make demo`, the tests and the benchmark."""
