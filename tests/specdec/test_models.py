"""Loading models: device and dtype choice, and refusal of a mismatched pair."""
import json
import shutil

import pytest
import torch

from specdec.model_files import end_token_ids
from specdec.models import ModelLoadError, check_pair, cuda_dtype, load_model, load_tokenizer, pick_device, pick_dtype


def test_bundled_pair_is_accepted(bundled_paths):
    check_pair(*bundled_paths)


def test_pair_with_a_different_vocabulary_is_refused(bundled_paths, tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(bundled_paths[0], draft)
    tok = json.loads((draft / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two ids swapped
    (draft / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ModelLoadError, match="do not share a vocabulary"):
        check_pair(draft, bundled_paths[1])


def test_pair_with_a_different_output_size_is_refused(bundled_paths, tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(bundled_paths[0], draft)
    cfg = json.loads((draft / "config.json").read_text())
    cfg["vocab_size"] += 64
    (draft / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="output logits"):
        check_pair(draft, bundled_paths[1])


def test_device_and_dtype_defaults():
    assert pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert pick_dtype("auto", torch.device("cpu")) == torch.float32
    assert pick_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ModelLoadError):
        pick_dtype("float8", torch.device("cpu"))


@pytest.mark.parametrize("name, words", [
    ("gpu", "unknown device 'gpu'; choose auto, cpu, cuda or cuda:N"),
    ("cuda:x", "unknown device 'cuda:x'"),
    ("meta", "device 'meta' is not served"),
    ("cuda:7" if torch.cuda.is_available() else "cuda:0", "requested but"),
])
def test_a_device_this_machine_cannot_serve_on_is_refused_by_name(name, words):
    with pytest.raises(ModelLoadError, match=words.replace("(", r"\(")):
        pick_device(name)


def test_gpus_before_ampere_default_to_fp16():
    """bf16 only where the tensor cores take it: torch's is_bf16_supported() says yes on a
    T4 or V100 (7.x) because it counts emulation."""
    assert cuda_dtype(7) == torch.float16 and cuda_dtype(6) == torch.float16
    assert cuda_dtype(8) == torch.bfloat16 and cuda_dtype(9) == torch.bfloat16


def test_missing_model_directory_is_a_clear_error(tmp_path):
    """A path written as one is never taken for a Hub id, whose naming rules would be the
    message; an empty directory is a model that cannot load."""
    with pytest.raises(ModelLoadError, match="no model directory at '.*nothing-here'"):
        load_model(tmp_path / "nothing-here", torch.device("cpu"), torch.float32)
    with pytest.raises(ModelLoadError, match="no tokenizer directory at '~/nothing-here-either'"):
        load_tokenizer("~/nothing-here-either")
    with pytest.raises(ModelLoadError, match="cannot load a model from"):
        load_model(tmp_path, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("eos, want", [(0, {0}), ([0, 7, 9], {0, 7, 9}), ([7], {0, 7}), (None, {0})])
def test_an_answer_ends_at_the_tokenizers_eos_and_the_generation_configs(tmp_path, tokenizer, eos, want):
    from tests.chat_tokenizer import chat_tokenizer_dir

    into = chat_tokenizer_dir(tmp_path / "model")
    config = json.loads((into / "generation_config.json").read_text())
    config["eos_token_id"] = eos
    (into / "generation_config.json").write_text(json.dumps(config))
    assert end_token_ids(into, tokenizer) == want


def test_a_model_without_a_generation_config_ends_at_its_tokenizers_eos(tmp_path, tokenizer):
    from tests.chat_tokenizer import chat_tokenizer_dir

    into = chat_tokenizer_dir(tmp_path / "model")
    (into / "generation_config.json").unlink()
    assert end_token_ids(into, tokenizer) == {tokenizer.eos_token_id}
