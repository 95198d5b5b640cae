"""A model's files: where the bundled pair lies, and what is read from a model's directory
(or Hub id) without loading its weights: its tokenizer and the tokens that end its answers.

Torch-free, as the orchestrator uses it: it tokenizes and detokenizes but computes no
tensors, and its process does not import torch (orchestrator/__main__.py). Loading the
weights is specdec/models.py's.
"""
from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BUNDLED_DIR = Path(os.environ.get("SPECDEC_BUNDLED_MODELS", REPO_ROOT / "models"))
BUNDLED_DRAFT = BUNDLED_DIR / "draft"
BUNDLED_TARGET = BUNDLED_DIR / "target"


class ModelLoadError(RuntimeError):
    pass


def local_only(path: str) -> bool:
    return Path(path).is_dir() or os.environ.get("HF_HUB_OFFLINE") == "1"


def check_local(path: str, what: str) -> None:
    """A path written as one (absolute, ./, ../ or ~) must be a directory here: otherwise
    Hugging Face would read it as a Hub id and answer with the rules of repository names."""
    if path.startswith(("/", "./", "../", "~")) and not Path(path).expanduser().is_dir():
        raise ModelLoadError(f"no {what} directory at {path!r}")


def load_tokenizer(path: str | os.PathLike):
    from transformers import AutoTokenizer  # here, not above: the paths need no transformers (localstack's CLI)

    path = str(path)
    check_local(path, "tokenizer")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=local_only(path))
    except OSError as exc:
        raise ModelLoadError(f"cannot load a tokenizer from {path!r}: {exc}") from exc


def end_token_ids(path: str | os.PathLike, tokenizer) -> frozenset[int]:
    """The tokens that end a model's answer: the tokenizer's EOS and those of the model's
    generation config (generation_config.json: an id or a list), as transformers'
    `generate()` ends on any of them. Chat models list their end of turn there beside the
    end of text (Llama 3.1 Instruct: <|end_of_text|>, <|eom_id|>, <|eot_id|>; Qwen2.5
    Instruct: <|im_end|>, <|endoftext|>), so an answer to `messages` ends with its turn. A
    model without a generation config has its tokenizer's EOS alone."""
    from transformers import GenerationConfig

    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    path = str(path)
    try:
        config = GenerationConfig.from_pretrained(path, local_files_only=local_only(path))
    except OSError:  # none: the tokenizer's EOS is all there is
        return frozenset(ids)
    eos = config.eos_token_id
    ids.update(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    return frozenset(int(i) for i in ids)
