"""When the orchestrator pre-drafts (PreDrafter.start and .wanted): a decision made from
the session's policy and the shared cost model, before any call."""
from orchestrator.draft_waits import DraftWaits
from orchestrator.gamma_policy import CostModel, SessionPolicy
from orchestrator.loop_state import Generation, Stats
from orchestrator.predraft import PreDrafter
from specdec.session_store import SessionHandle


def generation(deterministic: bool, greedy: bool = False) -> Generation:
    handle = SessionHandle("s", "draft-a:1", "target-a:1", 1, list(range(12)))
    policy = SessionPolicy(deterministic=deterministic, greedy=greedy)
    policy.accepted, policy.trials, policy.guessed, policy.guesses = 19.0, 20.0, 9.0, 10.0  # a pre-draft very likely used
    return Generation(handle, None, None, Stats(), policy, None, None, 0.0, 12, 0.0)


def predrafter(costs: CostModel) -> PreDrafter:
    return PreDrafter(costs, DraftWaits(0.25), lambda deadline: 30.0, max_len=2048, calls="frames")


def loaded_with_unused_predrafts() -> CostModel:
    """The other sessions share the target's batches and use few of their pre-drafts."""
    costs = CostModel()
    for _ in range(50):
        costs.batch.update(8.0)
    for _ in range(40):
        costs.observe_predraft(False, False)
    assert not costs.alone
    return costs


def test_an_adaptive_session_pre_drafts_while_it_is_likely_to_pay():
    assert predrafter(CostModel()).wanted(generation(deterministic=False), gamma=4) == (True, [])


def test_pre_drafts_that_others_did_not_use_under_load_stop_an_unseeded_session():
    drafter = predrafter(loaded_with_unused_predrafts())
    assert drafter.wanted(generation(deterministic=False), gamma=4)[0] is False


def test_a_seeded_sampled_session_never_pre_drafts():
    """Whether a pre-draft is made and used moves where a session's rounds end; a seeded
    session's must not turn on the other sessions or on a replica failing mid-call."""
    for costs in (CostModel(), loaded_with_unused_predrafts()):
        assert predrafter(costs).start(generation(deterministic=True), [1, 2, 3, 4], 4, 32, 12) is None


def first_round(draft_len: int = 0) -> Generation:
    """A call's first round under --first-round target: the draft replica has drafted
    nothing, its cache holds `draft_len` of the 12 prompt tokens."""
    gen = generation(deterministic=False, greedy=True)
    gen.prefill_round = True
    gen.handle.cursor.draft_len = draft_len
    return gen


def test_a_long_feed_goes_in_chunks_of_its_own_before_the_last_call():
    """`rounds.chunk_calls`: the calls a feed of `lacking` tokens makes before its last one,
    which carries the rest with its own work (a first round's pre-draft, a proposal, a
    verification)."""
    from specdec.rounds import chunk_calls

    assert [chunk_calls(n, 8) for n in (0, 1, 8, 9, 16, 17, 25)] == [0, 0, 0, 1, 1, 2, 3]
    assert chunk_calls(10_000, 0) == 0  # 0: no limit


def test_a_first_rounds_lookup_is_priced_at_the_lookups_rate():
    """The pre-draft after a looked-up first round is used only if the whole lookup is kept,
    which the session's lookup rate prices, not the draft's acceptance."""
    gen = first_round()
    gen.looked_up = True
    gen.lookup.kept, gen.lookup.missed = 1.0, 9.0  # lookups rarely kept
    assert predrafter(CostModel()).wanted(gen, gamma=3)[0] is False
    gen.looked_up = False  # the draft's own rates (0.95) would pre-draft
    assert predrafter(CostModel()).wanted(gen, gamma=3)[0] is True


def test_a_first_rounds_pre_draft_is_not_gated_by_the_kinds_use_rate():
    """Even where its guess is wrong a first round's pre-draft fed the draft the prompt the
    next proposal would feed: the use rate that stops wasted pre-drafts does not stop it."""
    costs = loaded_with_unused_predrafts()
    gen = first_round()
    gen.policy.greedy = False
    assert predrafter(costs).wanted(gen, gamma=0)[0] is True
    gen.prefill_round = False
    assert predrafter(costs).wanted(gen, gamma=0)[0] is False
