"""The draft pool: proposes γ tokens per session with the exact draft distributions."""
