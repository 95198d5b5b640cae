"""Weights held in 16 bits where that loses nothing, for the CPU's decode steps.

A decode step or a verification multiplies a few rows by every weight, so on a CPU its
matrix products cost what streaming the weights costs. Checkpoints are commonly stored in
float16 or bfloat16 (the bundled pair in float16) and served in float32 on a CPU, where
every weight is then a 16-bit value held in 32 bits. Held in 16 bits and widened in the
kernel (specdec/native/half_linear.cpp), the same values stream in half the bytes: the
products compute the same numbers as float32 weights, rounded apart only by the order of
their sums. A weight that some value would change in 16 bits is never held so.

The kernel is C++ compiled on first use with the machine's compiler (torch's
cpp_extension, about 30 s, then cached); where that fails the runner keeps its other
kernels and says so once in the log.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native") / "half_linear.cpp"
_lock = threading.Lock()
_module = None
_failed: str | None = None


def cache_dir() -> Path:
    """Where the compiled kernel is kept: $SPECDEC_KERNEL_CACHE, else ~/.cache/specdec/kernels."""
    root = os.environ.get("SPECDEC_KERNEL_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specdec" / "kernels"
    return Path(root)


def kernel():
    """The compiled extension (half_linear, panel_width, isa), or None where it cannot be
    built here (the reason is logged once and kept in `unavailable_reason()`)."""
    global _module, _failed
    if _module is not None or _failed is not None:
        return _module
    with _lock:
        if _module is None and _failed is None:
            try:
                _module = _build()
            except Exception as exc:  # no compiler, no x86, a read-only cache: keep serving without it
                _failed = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
                log.warning("16-bit weight kernel unavailable, serving with float32 products: %s", _failed)
    return _module


def unavailable_reason() -> str | None:
    return _failed


def _build():
    from torch.utils import cpp_extension

    try:  # the ninja wheel's binary, for a venv whose bin/ is not on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    source = SOURCE.read_bytes()
    tag = hashlib.sha256(source + torch.__version__.encode()).hexdigest()[:12]
    name = f"specdec_half_linear_{tag}"
    build = cache_dir() / name
    built = build / f"{name}.so"
    if built.exists():  # built before (or into the image): no compiler needed to load it
        spec = importlib.util.spec_from_file_location(name, built)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    build.mkdir(parents=True, exist_ok=True)
    log.info("compiling the 16-bit weight kernel into %s (once per machine, about 30 s)", build)
    return cpp_extension.load(name=name, sources=[str(SOURCE)], build_directory=str(build),
                              extra_cflags=["-O3"], verbose=False)


def main(argv: list[str] | None = None) -> int:
    """`python -m specdec.half_weights`: build the kernel now (make setup, the image)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m specdec.half_weights", description=main.__doc__)
    ap.add_argument("--cache", help="build into this directory (default $SPECDEC_KERNEL_CACHE or ~/.cache/specdec/kernels)")
    args = ap.parse_args(argv)
    if args.cache:
        os.environ["SPECDEC_KERNEL_CACHE"] = args.cache
    logging.basicConfig(level="INFO", format="%(message)s")
    module = kernel()
    if module is None:
        print(f"16-bit weight kernel not built: {unavailable_reason()}")
        return 1
    print(f"16-bit weight kernel ready in {cache_dir()}: {module.isa()}, panels of {module.panel_width()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def lossless_dtype(weight: torch.Tensor) -> torch.dtype | None:
    """float16 or bfloat16 if every value of the float32 `weight` is one exactly, else None."""
    if weight.dtype != torch.float32:
        return None
    for dtype in (torch.float16, torch.bfloat16):
        narrow = weight.to(dtype)
        if torch.equal(narrow.float(), weight):
            return dtype
    return None


def pack(weight: torch.Tensor, dtype: torch.dtype, panel: int) -> torch.Tensor:
    """[out, in] → [panels, in, panel] in `dtype`, the last panel padded with zeros."""
    out, inner = weight.shape
    padded = F.pad(weight.to(dtype), (0, 0, 0, (-out) % panel))
    return padded.view(-1, panel, inner).transpose(1, 2).contiguous()
