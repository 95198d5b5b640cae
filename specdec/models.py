"""Loading a draft or target model (local directory, or a Hub id where a hub is reachable),
choosing the device and dtype once at start, and refusing pairs that cannot work together.
"""
from __future__ import annotations

import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specdec import model_files
from specdec.model_files import ModelLoadError, check_local, load_tokenizer, local_only

# where the bundled pair lies: model_files says (torch-free, for the orchestrator); named here
# too, beside the loaders, for the servers, benchmarks and tests that load the pair
REPO_ROOT, BUNDLED_DRAFT, BUNDLED_TARGET = model_files.REPO_ROOT, model_files.BUNDLED_DRAFT, model_files.BUNDLED_TARGET

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
DTYPE_NAMES = ("auto", *_DTYPES)  # what --dtype accepts (`pick_dtype`)


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 → "bfloat16": how reports and the registry name a served dtype."""
    return str(dtype).removeprefix("torch.")


def pick_device(name: str = "auto") -> torch.device:
    """`--device`: auto (CUDA where present), cpu, cuda or cuda:N; anything else, or a GPU
    this machine lacks, is refused with a line saying so (not torch's traceback)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ModelLoadError(f"unknown device {name!r}; choose auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ModelLoadError(f"device {name!r} is not served; choose auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {name!r} requested but CUDA is not available on this machine")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ModelLoadError(f"device {name!r} requested but this machine has {count} CUDA device(s)")
    return device


def cuda_dtype(major: int) -> torch.dtype:
    """The default dtype on a CUDA device of compute capability `major`.x: bf16 where the
    tensor cores take it (Ampere, 8.x, and later), else fp16. torch's
    `is_bf16_supported()` counts emulation too, so it says yes on a T4 or V100 (7.x),
    whose bf16 products then run without tensor cores."""
    return torch.bfloat16 if major >= 8 else torch.float16


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """fp32 on CPU (bf16 matmuls are slower there at batch 1), bf16 on GPU by default (fp16
    on GPUs before Ampere: `cuda_dtype`)."""
    if name == "auto":
        if device.type == "cuda":
            return cuda_dtype(torch.cuda.get_device_capability(device)[0])
        return torch.float32
    if name not in _DTYPES:
        raise ModelLoadError(f"unknown dtype {name!r}; choose one of auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[name]


def load_model(path: str | os.PathLike, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    path = str(path)
    check_local(path, "model")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=local_only(path))
    except (OSError, ValueError) as exc:  # ValueError: a directory without a model's config
        raise ModelLoadError(f"cannot load a model from {path!r}: {exc}") from exc
    if config.model_type not in SUPPORTED_TYPES:
        raise ModelLoadError(f"{path}: model type {config.model_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_TYPES)})")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=local_only(path))
    return model.to(device).eval()


def vocab_size_of(path: str | os.PathLike) -> int:
    config = AutoConfig.from_pretrained(str(path), local_files_only=local_only(str(path)))
    return int(config.vocab_size)


def check_pair(draft_path: str | os.PathLike, target_path: str | os.PathLike) -> None:
    """Refuse a draft/target pair that does not share a vocabulary: speculation compares
    their distributions token by token, so the ids must mean the same strings."""
    draft_tok, target_tok = load_tokenizer(draft_path), load_tokenizer(target_path)
    if draft_tok.get_vocab() != target_tok.get_vocab():
        raise ModelLoadError(
            f"draft {draft_path} and target {target_path} do not share a vocabulary "
            f"({len(draft_tok)} vs {len(target_tok)} tokens, or the same size with different ids); "
            "speculative decoding needs a draft trained with the target's tokenizer")
    dv, tv = vocab_size_of(draft_path), vocab_size_of(target_path)
    if dv != tv:
        raise ModelLoadError(f"draft {draft_path} has {dv} output logits but target {target_path} has {tv}")
