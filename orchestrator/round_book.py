"""A finished round's bookkeeping: what it and its calls tell the generation's stats, the
shared cost model, the load governor and the metrics. None of it decides the next round's
call, so the loop runs it after that call has left (`Generator._finish_round`), a round
late for the next choice."""
from __future__ import annotations

from orchestrator.gamma_policy import CostModel
from orchestrator.governor import LoadGovernor
from orchestrator.loop_state import Call, Generation, Round, Stats
from specdec import metrics


def record_round(costs: CostModel, governor: LoadGovernor, gen: Generation, book: Round) -> None:
    """A plain round's time outside its two calls (the loop's own work, waiting for the
    previous commit) is added by the cost model to every γ's round: paid once a round, it
    favours rounds that yield more tokens."""
    policy = gen.policy
    for call in book.calls:
        note_call(costs, gen.stats, call)
    if book.looked_up:  # not the draft replicas' acceptance, which the γ policy prices
        metrics.LOOKUP_DRAFTED.inc(book.gamma)
        metrics.LOOKUP_ACCEPTED.inc(book.accepted)
    else:
        costs.observe_acceptance(policy.greedy, book.gamma, book.accepted, book.chances)
    if book.plain:
        costs.observe_round_overhead(book.seconds * 1000 - book.calls_ms, book.calls_ms)
    if gen.governed:
        governor.observe(policy.greedy, book.active, book.speculating, book.tokens, book.seconds,
                         book.rounds_in_mode)
    metrics.ROUNDS.inc()
    metrics.GAMMA.observe(book.gamma)
    if book.gamma and not book.looked_up:
        metrics.DRAFTED.inc(book.gamma)
        metrics.ACCEPTED.inc(book.accepted)
        metrics.ACCEPTED_LENGTH.observe(book.accepted)
        for i in range(book.gamma):
            metrics.at_position(metrics.DRAFTED_AT_POSITION, i).inc()
            if i < book.accepted:
                metrics.at_position(metrics.ACCEPT_AT_POSITION, i).inc()


def note_call(costs: CostModel, stats: Stats, call: Call) -> None:
    """A call's network time, bytes (sizing a message serializes it: 32 KB for a sampled
    proposal), cost sample (steady rounds only: a prefill is no measure of a round's call;
    nor is a verification that rebuilt the target's cache) and stage metric."""
    resp = call.response
    stats.network_ms += max(0.0, call.ms - resp.compute_ms)
    stats.wire_bytes += resp.ByteSize() + (call.request.ByteSize() if call.request is not None else 0)
    if call.pool == "draft":
        if call.steady:
            costs.observe_draft(len(resp.draft_tokens), call.ms, resp.compute_ms, resp.batch_size)
        if len(resp.draft_tokens) < call.tokens:
            metrics.DRAFT_STOPS.inc()
        metrics.DRAFT_STAGE.observe(call.ms / 1000)
        return
    if call.steady and not resp.resynced:
        costs.observe_verify(call.tokens, call.ms, resp.batch_size, resp.compute_ms, resp.batch_tokens)
    metrics.VERIFY_STAGE.observe(call.ms / 1000)
