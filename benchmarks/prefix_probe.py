"""What prefix reuse saves a new session's first call: `python -m benchmarks.prefix_probe`.

In one process on the bundled pair's engines: a donor session feeds a long shared prefix
(a system prompt of `--prefix` tokens) and a question; then new sessions with the same
prefix and other questions make their first call (a draft proposal of γ tokens and the
target's verification of it: what a request waits for before its first tokens), by turns
with prefix reuse on and off in the replicas' session tables. Prints the median ms of each
and checks that the two ways verify the same tokens.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.models import BUNDLED_DRAFT, BUNDLED_TARGET, load_model
from specdec.sampling import SamplingParams
from specdec.sessions import CacheRef


def first_call(draft, target, sid: str, tokens: list[int], gamma: int) -> tuple[float, float, tuple]:
    """(proposal ms, verification ms, (draft tokens, kept, next token)) of a new session's first round."""
    from draft_service.engine import ProposeJob
    from target_service.engine import VerifyJob

    greedy = SamplingParams(0.0)
    t0 = time.perf_counter()
    proposal = draft.propose([ProposeJob(CacheRef(sid, 1, 0, tokens), gamma, greedy)])[0]
    t1 = time.perf_counter()
    verdict = target.verify([VerifyJob(CacheRef(sid, 1, 0, tokens), proposal.tokens, None, greedy)])[0]
    t2 = time.perf_counter()
    if isinstance(proposal, Exception) or isinstance(verdict, Exception):
        raise SystemExit(f"prefix_probe: {proposal if isinstance(proposal, Exception) else verdict}")
    draft.release(sid)
    target.release(sid)
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, (tuple(proposal.tokens), verdict.accepted, verdict.next_token)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.prefix_probe", description=__doc__.split("\n\n")[1])
    ap.add_argument("--prefix", type=int, default=512, help="tokens of the shared prefix (default 512)")
    ap.add_argument("--question", type=int, default=24, help="tokens after it, each session its own (default 24)")
    ap.add_argument("--rounds", type=int, default=10, help="new sessions per way (default 10)")
    ap.add_argument("--gamma", type=int, default=4, help="draft tokens of the first round (default 4)")
    ap.add_argument("--draft", default=str(BUNDLED_DRAFT), help="draft model directory (default: bundled)")
    ap.add_argument("--target", default=str(BUNDLED_TARGET), help="target model directory (default: bundled)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.prefix, args.question, args.rounds, args.gamma) < 1:
        raise SystemExit("--prefix, --question, --rounds and --gamma must be at least 1")
    from benchmarks.inprocess import build_engines
    from specdec.sessions import MIN_SHARED

    if args.prefix < MIN_SHARED:
        raise SystemExit(f"--prefix: at least {MIN_SHARED} tokens (shorter prefixes are not reused)")
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    draft, target = build_engines(load_model(args.draft, cpu, torch.float32), load_model(args.target, cpu, torch.float32))
    vocab = target.runner.vocab_size
    if args.prefix + args.question + args.gamma + 1 > min(draft.runner.max_length, target.runner.max_length):
        raise SystemExit("--prefix and --question exceed the models' context")
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(10, vocab, (args.prefix,), generator=gen).tolist()
    questions = [torch.randint(10, vocab, (args.question,), generator=gen).tolist() for _ in range(args.rounds + 1)]
    # the donor: a session that keeps the prefix (and its own question) in both caches
    from draft_service.engine import ProposeJob
    from target_service.engine import VerifyJob

    donor = prefix + questions[0]
    draft.propose([ProposeJob(CacheRef("donor", 1, 0, donor), 1, SamplingParams(0.0))])
    target.verify([VerifyJob(CacheRef("donor", 1, 0, donor), [], None, SamplingParams(0.0))])
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for k, question in enumerate(questions[1:]):
        outcomes = {}
        for reuse in ((True, False) if k % 2 == 0 else (False, True)):
            for engine in (draft, target):
                engine.sessions.reuse_prefixes = reuse
            *ms, outcomes[reuse] = first_call(draft, target, f"s{k}-{reuse}", prefix + question, args.gamma)
            times[reuse].append(tuple(ms))
        if outcomes[True] != outcomes[False]:
            raise SystemExit(f"prefix_probe: session {k} verified other tokens with and without reuse")
    print(f"a new session's first round after a {args.prefix}-token shared prefix and a {args.question}-token "
          f"question, γ = {args.gamma}; the same tokens either way over {args.rounds} sessions")
    print("| ms, median | proposal | verification | both |\n|---|---|---|---|")
    for reuse in (False, True):
        p, v = (statistics.median(x) for x in zip(*times[reuse]))
        both = statistics.median(a + b for a, b in times[reuse])
        print(f"| prefix reuse {'on' if reuse else 'off'} | {p:.2f} | {v:.2f} | {both:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
