"""The compile probe times the runner against a single-session forward; that forward must
be the runner's own, or the comparison says nothing. Compiling itself is left to the probe
(half a minute to minutes on this CPU)."""
import pytest
import torch

from benchmarks import compile_probe
from specdec.model_runner import ForwardItem, ModelRunner


@pytest.mark.parametrize("n", [1, 5])
def test_single_session_forward_is_the_runners_forward_bit_for_bit(target_model, n):
    runner = ModelRunner(target_model, linear_kernels="aten", attention="sdpa")  # as the probe writes it
    forward = compile_probe.single_session_forward(runner)
    ours, theirs = runner.new_cache(), runner.new_cache()
    prompt = torch.arange(40) * 13 % runner.vocab_size
    ids = torch.arange(n) * 7 + 3
    with torch.inference_mode():
        runner.forward_packed([ForwardItem(ours, prompt, 1)])
        theirs.reserve(40 + n)
        forward(theirs.kv, prompt, 0)
        expected = runner.forward_packed([ForwardItem(ours, ids, n)])
        got = forward(theirs.kv, ids, 40)
    assert torch.equal(got, expected)
    assert torch.equal(theirs.kv[:, :, : 40 + n], ours.kv[:, :, : 40 + n])  # the same keys and values cached


def test_probe_refuses_bad_arguments():
    with pytest.raises(SystemExit, match="positive"):
        compile_probe.main(["--calls", "0"])
    with pytest.raises(SystemExit, match="2048"):
        compile_probe.main(["--cache", "2047", "--tokens", "5"])
