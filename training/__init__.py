"""Trains the bundled draft/target pair on the Python standard library (offline, seeded)."""
