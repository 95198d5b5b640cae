"""DraftEngine on the bundled draft: greedy proposals take the argmax and carry no
distributions (the greedy rule needs none), sampled ones carry exactly what they were
drawn from, and a session drafts the same tokens alone or in a mixed batch."""
import torch

from draft_service.engine import DraftEngine, ProposeJob
from specdec.model_runner import ModelRunner
from specdec.sampling import SamplingParams
from specdec.sessions import CacheRef

GAMMA = 5


def test_greedy_proposals_are_the_argmax_and_carry_no_distributions(draft_model, tokenizer):
    engine = DraftEngine(ModelRunner(draft_model))
    ids = tokenizer("def walk(root):\n    for name in ")["input_ids"]
    greedy, sampled = SamplingParams(0.0), SamplingParams(1.0, seed=9)

    alone = engine.propose([ProposeJob(CacheRef("alone", 1, 0, ids), GAMMA, greedy)])[0]
    mixed = engine.propose([ProposeJob(CacheRef("g", 1, 0, ids), GAMMA, greedy),
                            ProposeJob(CacheRef("s", 1, 0, ids), GAMMA, sampled)])

    expected = draft_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=GAMMA,
                                    pad_token_id=tokenizer.eos_token_id)[0, len(ids):].tolist()
    assert alone.tokens == expected and alone.q is None
    assert mixed[0].tokens == expected and mixed[0].q is None
    q = mixed[1].q
    assert q is not None and tuple(q.shape) == (GAMMA, engine.runner.vocab_size)
    assert torch.equal(q, q.half().float())  # fp16-exact: what travels is what was sampled from
    assert all(q[i, t] > 0 for i, t in enumerate(mixed[1].tokens))


def test_a_pre_draft_guesses_the_bonus_under_the_targets_noise(draft_model, tokenizer):
    """guess_bonus: the first token is drawn from its q with the bonus stream's noise
    at its position (what the target's bonus is drawn with), and the tokens after it are
    exactly what a plain proposal drafts on the prefix that ends in the guess."""
    from specdec import sampling

    engine = DraftEngine(ModelRunner(draft_model))
    ids = tokenizer("def walk(root):\n    for name in ")["input_ids"]
    params = SamplingParams(1.0, seed=21)
    pre = engine.propose([ProposeJob(CacheRef("pre", 1, 0, ids), GAMMA, params, guess_bonus=True)])[0]
    noise = sampling.bonus_noise([21], [len(ids)], engine.runner.vocab_size)
    assert pre.tokens[0] == int(sampling.race_argmax(pre.q[:1], noise)[0])
    # the same prefix the same way: the prompt's prefill, then the guess as one step
    engine.propose([ProposeJob(CacheRef("plain", 1, 0, ids), 1, params)])
    plain = engine.propose([ProposeJob(CacheRef("plain", 1, len(ids), pre.tokens[:1]), GAMMA - 1, params)])[0]
    assert plain.tokens == pre.tokens[1:]
    assert torch.equal(plain.q, pre.q[1:])
    # a greedy guess is the argmax, as any greedy draft token
    greedy = engine.propose([ProposeJob(CacheRef("g", 1, 0, ids), 2, SamplingParams(0.0), guess_bonus=True)])[0]
    assert greedy.tokens == engine.propose([ProposeJob(CacheRef("g2", 1, 0, ids), 2, SamplingParams(0.0))])[0].tokens
