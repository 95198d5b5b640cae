"""A refusal raised from a job's result leaves no reference cycle behind."""
import gc

from specdec.errors import InvalidRequest, value_or_raise


def _refused() -> InvalidRequest:
    return InvalidRequest("no")  # a batch's result for the job: an error, as a value


def _raises(handler) -> None:
    try:
        handler(_refused)
    except InvalidRequest:
        pass


def test_value_or_raise_leaves_no_cycle_where_raising_from_a_local_did():
    def servicer(submit):
        request = bytearray(1 << 20)  # what a servicer's frame holds: the request, the job
        return value_or_raise(submit()), request

    def before(submit):  # the pattern it replaced
        request = bytearray(1 << 20)
        result = submit()
        if isinstance(result, Exception):
            raise result
        return result, request

    gc.collect()
    gc.disable()
    try:
        _raises(servicer)
        assert gc.collect() == 0
        _raises(before)
        assert gc.collect() > 0  # the frame, its request and the error, in a cycle
    finally:
        gc.enable()
    assert value_or_raise(5) == 5 and servicer(lambda: 7)[0] == 7
