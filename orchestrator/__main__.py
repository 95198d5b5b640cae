"""`python -m orchestrator`: the orchestrator's process, which runs without torch.

It tokenizes, detokenizes and moves draft rows as bytes, but computes no tensors, so its
modules import none (tests/orchestrator/test_no_torch.py). Told that torch is absent,
transformers loads a tokenizer without importing it either (its `is_torch_available`
looks for the module): the process starts in about a second rather than three and holds
about 180 MB less (README, "The orchestrator runs without torch").
"""
import os
import sys

sys.modules.setdefault("torch", None)  # an import of torch now fails at once, as if it were not installed
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # its "PyTorch was not found" line

from orchestrator.server import main  # noqa: E402  (after the two lines above, by design)

main()
