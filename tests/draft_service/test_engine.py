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
