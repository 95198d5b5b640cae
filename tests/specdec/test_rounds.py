"""rounds.Ends: which of a round's tokens end an answer."""
from specdec.rounds import Ends


def test_an_answer_ends_at_eos_or_at_the_first_stop_token_and_keeps_it():
    ends = Ends(eos_ids=frozenset({2}), stop_ids=frozenset({7, 9}))
    assert ends.cut([4, 5, 6]) == ([4, 5, 6], None)
    assert ends.cut([4, 2, 7]) == ([4, 2], "eos")
    assert ends.cut([4, 9, 2]) == ([4, 9], "stop")
    assert ends.cut([7]) == ([7], "stop")
    assert ends.cut([]) == ([], None)


def test_an_ignored_eos_ends_nothing_unless_it_is_a_stop_token():
    assert Ends(stop_ids=frozenset({7})).cut([2, 5, 2]) == ([2, 5, 2], None)
    assert Ends(stop_ids=frozenset({2})).cut([5, 2, 6]) == ([5, 2], "stop")
    assert Ends().cut([0, 1, 2]) == ([0, 1, 2], None)


def test_the_end_tokens_are_eos_and_the_stop_tokens():
    assert Ends(eos_ids=frozenset({2}), stop_ids=frozenset({7})).tokens == {2, 7}
    assert Ends(stop_ids=frozenset({7})).tokens == {7} and Ends().tokens == frozenset()
