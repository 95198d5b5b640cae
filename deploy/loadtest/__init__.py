"""Load testing the orchestrator: ghz configurations (ghz/) and a Python load generator."""
