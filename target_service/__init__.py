"""The target pool: verifies whole drafts of many sessions in one forward pass."""
