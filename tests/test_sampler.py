"""SamplingParams validation and the sampler's filters (exact)."""
import pytest
import torch

from engine_min.sampler import Sampler, SamplingParams, filter_logits


@pytest.mark.parametrize("kw, msg", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"), ({"top_k": -1}, "top_k"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"seed": "x"}, "seed"),
    ({"seed": 2**64}, "seed must be an int in"), ({"seed": -2**63 - 1}, "seed must be an int in"),
])
def test_validation(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


def test_stop_string_is_wrapped():
    assert SamplingParams(stop="\n").stop == ["\n"]


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    kept = filter_logits(logits, 2, 1.0).isfinite().tolist()
    assert kept == [True, True, False, False, False]
    # top_p 0.8: 0.5 + 0.2 = 0.7 < 0.8, so 0.15 is needed too; 0.1 and 0.05 are dropped
    assert filter_logits(logits, 0, 0.8).isfinite().tolist() == [True, True, True, False, False]
    assert filter_logits(logits, 0, 0.3).isfinite().tolist() == [True, False, False, False, False]


def test_greedy_and_seeded_sampling():
    s = Sampler(seed=0)
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0]])
    assert s.sample(logits, [SamplingParams(), SamplingParams()], [None, None]) == [1, 0]
    p = SamplingParams(temperature=1.0, seed=5)
    row = torch.zeros(1, 50)
    draws = [s.sample(row, [p], [torch.Generator().manual_seed(5)])[0] for _ in range(2)]
    assert draws[0] == draws[1]
    many = {s.sample(row, [SamplingParams(temperature=1.0)], [None])[0] for _ in range(30)}
    assert len(many) > 5                                # the shared generator moves on
    top1 = SamplingParams(temperature=2.0, top_k=1)
    assert s.sample(torch.tensor([[0.0, 0.1, 0.05]]), [top1], [None]) == [1]
