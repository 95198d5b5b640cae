"""The GPU's checks (benchmarks/cuda_check.py, run first on a lent GPU machine) run here with
the GPU's layout forced, so that the script works when a device comes, and fail where the
layout does not give Hugging Face's numbers."""
import pytest
import torch

from benchmarks import cuda_check
from specdec.models import BUNDLED_TARGET
from specdec import model_runner


def test_the_gpu_checks_pass_here_with_the_gpu_layout(capsys):
    assert cuda_check.main(["--device", "cpu", "--prompts", "1", "--tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert out.count("forward ") == 8 and out.count("batch ") == 4 and out.count("wire ") == 2
    assert out.count("verdicts ") == 2 and "over fp16 rows == over float64 rows in 12 of 12" in out
    assert out.count("loop ") == 1 and "loop     prompt 0 paged" in out
    assert "FAIL" not in out and out.rstrip().endswith("all checks passed")


def test_a_wrong_fold_of_the_query_heads_fails_the_grouped_model_only(capsys, monkeypatch):
    right = model_runner.grouped_attention

    def unfolded(q, keys, values, mask, scale, fold=False):  # heads paired with the wrong kv heads
        if fold and q.shape[0] != keys.shape[0]:
            q = q.flip(0)
        return right(q, keys, values, mask, scale, fold)

    monkeypatch.setattr(model_runner, "grouped_attention", unfolded)
    assert cuda_check.main(["--device", "cpu", "--prompts", "1", "--tokens", "8"]) == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("forward")]
    # SDPA per session takes the fold; the paged batch's attention does not
    assert [line.endswith("ok") for line in lines] == [True] * 4 + [False, True, False, True], lines


def test_a_paged_mask_that_lets_a_query_see_the_next_key_fails_every_paged_check(capsys, monkeypatch):
    from specdec import paged_attention

    right = paged_attention._group

    def leaky(members, caches, starts, lengths, offsets, fold, dtype, device):
        return right(members, caches, [s + 1 for s in starts], lengths, offsets, fold, dtype, device)

    monkeypatch.setattr(paged_attention, "_group", leaky)
    cpu = torch.device("cpu")
    # as main() runs them: a check that raises fails with its error
    assert not cuda_check._run(cuda_check.check_paged_batch, "target", BUNDLED_TARGET, cpu, torch.float32, True)
    assert not cuda_check._run(cuda_check.check_forward, "target", BUNDLED_TARGET, cpu, torch.float32, True, "paged")
    assert cuda_check._run(cuda_check.check_forward, "target", BUNDLED_TARGET, cpu, torch.float32, True, "sdpa")
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and "FAIL" in out[0] and "FAIL" in out[1] and out[2].endswith("ok"), out


def test_an_unknown_device_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        cuda_check.main(["--device", "gpu"])
    assert exit_.value.code == 2
    assert "unknown device 'gpu'" in capsys.readouterr().err
