"""Fixtures of the specdec tests: specdec.native's kernels on each instruction set, and a
call made natively and by torch's operators."""
import pytest

from specdec import native

ISAS = ("avx512", "avx2", "scalar")


@pytest.fixture(params=ISAS)
def isa(request):
    """The native kernels run on `request.param` for the test (skipped where this CPU lacks
    it), then on the best again: one machine checks every path it can run."""
    module = native.module()
    assert module is not None, native.unavailable_reason()
    order = ISAS.index
    if order(request.param) < order(module.best_isa()):
        pytest.skip(f"this CPU has no {request.param}")
    before = module.set_isa(request.param)
    yield request.param
    module.set_isa(before)


@pytest.fixture
def both_ways(monkeypatch):
    """`both_ways(call, *args)` → [its result with specdec.native loaded, without it]; a
    refusal (ValueError, WireFormatError among them) as its words."""
    kernels = native.module()

    def run(call, *args):
        out = []
        for loaded in (lambda: kernels, lambda: None):
            with monkeypatch.context() as patch:
                patch.setattr(native, "loaded", loaded)
                try:
                    out.append(call(*args))
                except ValueError as exc:
                    out.append(str(exc))
        return out
    return run
