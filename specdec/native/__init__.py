"""specdec's CPU kernels in C++ (this folder), compiled on first use with the machine's
compiler through torch's cpp_extension (about 40 s, then cached) or loaded prebuilt:

- `half_linear`: matrix products over weights held in 16 bits (specdec.half_weights), or
  int8 ones (a quantised draft), and `int8_dot_linear`: int8 weights times int8-rounded
  rows by the CPU's 8-bit dot products (specdec.quantize's w8a8);
- `packed_attention`: one call per layer for every session's causal attention
  (specdec.model_runner);
- `decoder_layer`: a whole Llama layer over those two, in one call, and `rms_norm`, the
  same norm for the model's final one;
- `sample_rows`: inverse-CDF draws of whole rows, specdec.sampling.sample_from's to the bit;
- `block_verdicts`: the block rule's verdicts for a batch of sampled sessions (the target
  engine's), and `residual_masses`, specdec.sampling.residual_mass's sums to the bit;
- `decode_fp16_rows`: a draft's dense fp16 distributions into normalised float64 rows,
  specdec.wire.decode's to the bit; `fp16_row_sums`: their rows' sums alone, as
  specdec.wire.decode_half keeps the values fp16.

Each kernel picks AVX-512, AVX2 or plain C++ when it loads, so one build serves any
x86-64 CPU. Where the build fails (no compiler, another architecture) `module()` is None,
the reason is logged once, and the runner keeps torch's own operators.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = sorted(Path(__file__).parent.glob("*.cpp"))
HEADERS = sorted(Path(__file__).parent.glob("*.h")) + sorted(Path(__file__).parent.glob("*.inc"))
_lock = threading.Lock()
_module = None
_failed: str | None = None


def cache_dir() -> Path:
    """Where the compiled module is kept: $SPECDEC_KERNEL_CACHE, else ~/.cache/specdec/kernels."""
    root = os.environ.get("SPECDEC_KERNEL_CACHE") or \
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specdec" / "kernels"
    return Path(root)


def module():
    """The compiled extension, or None where it cannot be built here (the reason is logged
    once and kept in `unavailable_reason()`)."""
    global _module, _failed
    if _module is not None or _failed is not None:
        return _module
    with _lock:
        if _module is None and _failed is None:
            try:
                _module = _load()
            except Exception as exc:  # no compiler, another architecture, a read-only cache
                lines = str(exc).strip().splitlines()
                _failed = f"{type(exc).__name__}: {lines[-1] if lines else ''}"
                log.warning("specdec's CPU kernels are unavailable, serving with torch's operators: %s", _failed)
    return _module


def loaded():
    """The extension if a model runner has loaded it in this process, else None: for the
    sampling core, which should use the kernels where they are but never wait for a build."""
    return _module


def unavailable_reason() -> str | None:
    return _failed


def _load():
    digest = hashlib.sha256(torch.__version__.encode())
    for source in SOURCES + HEADERS:
        digest.update(source.name.encode() + source.read_bytes())
    name = f"specdec_native_{digest.hexdigest()[:12]}"
    build = cache_dir() / name
    built = build / f"{name}.so"
    # built before, or into the image: no compiler needed to load it (unless another process
    # holds torch's build lock there and may be writing the library right now)
    if built.exists() and not (build / "lock").exists():
        spec = importlib.util.spec_from_file_location(name, built)
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
        return loaded
    try:  # the ninja wheel's binary, for a venv whose bin/ is not on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    from torch.utils import cpp_extension

    build.mkdir(parents=True, exist_ok=True)
    log.info("compiling specdec's CPU kernels into %s (once per machine, about 40 s)", build)
    return cpp_extension.load(name=name, sources=[str(s) for s in SOURCES], build_directory=str(build),
                              extra_cflags=["-O3"], verbose=False)


def build_parser():
    import argparse

    ap = argparse.ArgumentParser(prog="python -m specdec.native", description=main.__doc__)
    ap.add_argument("--cache", help="build into this directory (default $SPECDEC_KERNEL_CACHE or ~/.cache/specdec/kernels)")
    return ap


def main(argv: list[str] | None = None) -> int:
    """`python -m specdec.native`: build (or find) the kernels now, as make setup and the
    image do, so that no server's start waits for the compiler."""
    args = build_parser().parse_args(argv)
    if args.cache:
        os.environ["SPECDEC_KERNEL_CACHE"] = args.cache
    logging.basicConfig(level="INFO", format="%(message)s")
    if module() is None:
        print(f"specdec's CPU kernels were not built: {unavailable_reason()}")
        return 1
    print(f"specdec's CPU kernels are ready in {cache_dir()}: {module().isa()}")
    return 0
