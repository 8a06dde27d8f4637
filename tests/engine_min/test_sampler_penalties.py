"""vLLM's penalties and min-p in the sampler, on hand-computed logits: repetition (prompt or
output, positive divided, negative multiplied), frequency (per output occurrence) and presence
(once per output token), each row of a batch with its own params; min-p after temperature and
before top-p; greedy rows are penalized too; and the range checks of ``SamplingParams``."""
import math

import pytest
import torch

from engine_min.sampler import Sampler, SamplingParams, apply_penalties, filter_logits

ROW = [2.0, -1.0, 0.5, -2.0, 3.0, 0.0]


@pytest.mark.parametrize("kw, msg", [
    ({"repetition_penalty": 0}, "repetition_penalty must be a finite number > 0"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"repetition_penalty": math.nan}, "repetition_penalty"),
    ({"repetition_penalty": True}, "repetition_penalty"),
    ({"min_p": -0.01}, r"min_p must be a number in \[0, 1\]"), ({"min_p": 1.01}, "min_p"),
    ({"min_p": math.nan}, "min_p"),
    ({"presence_penalty": 2.01}, r"presence_penalty must be a number in \[-2, 2\]"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, r"frequency_penalty must be a number in \[-2, 2\]"),
    ({"frequency_penalty": math.inf}, "frequency_penalty"),
])
def test_out_of_range_penalties_and_min_p_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


def test_range_ends_are_accepted():
    p = SamplingParams(repetition_penalty=1e-3, min_p=1.0, presence_penalty=-2,
                       frequency_penalty=2)
    assert p.penalized and SamplingParams(min_p=0.0).penalized is False


def test_penalties_exact_values_each_row_its_own_params():
    logits = torch.tensor([ROW, ROW, ROW])
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5,
                             presence_penalty=0.25),
              SamplingParams(),
              SamplingParams(repetition_penalty=0.5)]
    # row 0: prompt [0, 1], output [2, 2, 3]; row 2: prompt [0, 1, 3, 3] and no output yet
    hist = [([0, 1, 2, 2, 3], 2), ([0, 1, 2, 2, 3], 2), ([0, 1, 3, 3], 4)]
    out = apply_penalties(logits, params, hist)
    # 0: 2/2 = 1 (prompt); 1: -1*2 = -2 (prompt); 2: 0.5/2 - 0.5*2 - 0.25 = -1.0;
    # 3: -2*2 - 0.5*1 - 0.25 = -4.75; 4 and 5 never seen
    assert out[0].tolist() == [1.0, -2.0, -1.0, -4.75, 3.0, 0.0]
    assert out[1].tolist() == ROW                               # no penalty: untouched
    # a penalty below 1 rewards: 2/0.5 = 4, -1*0.5 = -0.5, -2*0.5 = -1 (3 counted once)
    assert out[2].tolist() == [4.0, -0.5, 0.5, -1.0, 3.0, 0.0]
    assert logits[0].tolist() == ROW                            # the input is not modified


def test_repetition_penalty_counts_output_tokens_and_presence_only_output():
    logits = torch.tensor([ROW, ROW])
    params = [SamplingParams(repetition_penalty=4.0), SamplingParams(presence_penalty=-1.5)]
    hist = [([5], 0), ([0, 4], 1)]           # row 0: output only; row 1: token 0 is prompt
    out = apply_penalties(logits, params, hist)
    assert out[0].tolist() == ROW                     # 0 / 4 and 0 * 4: a zero stays zero
    assert out[1].tolist() == [2.0, -1.0, 0.5, -2.0, 4.5, 0.0]   # presence: output only


def test_no_penalized_row_returns_the_same_tensor():
    logits = torch.tensor([ROW])
    assert apply_penalties(logits, [SamplingParams(min_p=0.5)], [([0, 1], 1)]) is logits


def test_greedy_row_is_penalized_and_a_bad_row_still_fails_alone():
    s = Sampler(seed=0)
    logits = torch.tensor([[3.0, 2.0, -1.0], [3.0, 2.0, float("nan")],
                           [torch.finfo(torch.float32).min, 2.0, 1.0]])
    rep = SamplingParams(repetition_penalty=2.0)
    hist = [([0], 1), ([0], 1), ([0, 1], 2)]
    out = apply_penalties(logits, [rep] * 3, hist)
    # row 0: 3/2 = 1.5 < 2: greedy moves to token 1; row 2: the lowest float (min_tokens)
    # times 2 overflows and is clamped back to the lowest finite float
    assert out[2].tolist() == [torch.finfo(torch.float32).min, 1.0, 1.0]
    tokens = s.sample_rows(out, [rep] * 3, [None] * 3)
    assert tokens[0] == 1 and tokens[2] == 1
    assert isinstance(tokens[1], ValueError) and "1 NaN" in str(tokens[1])
    assert s.sample(logits[:1], [SamplingParams()], [None]) == [0]


def test_histories_must_match_the_rows():
    with pytest.raises(ValueError, match="2 logit rows, 2 params, 1 histories"):
        apply_penalties(torch.zeros(2, 4), [SamplingParams(presence_penalty=1)] * 2, [([0], 1)])
    assert apply_penalties(None, [], []) is None            # a step where nothing samples


def test_min_p_filter_exact_and_top_p_counts_what_min_p_kept():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05], dtype=torch.float64))
    # kept: probability >= min_p * 0.5; ratios 0.4, 0.3, 0.2, 0.1
    assert filter_logits(logits, 0, 1.0, 0.35).isfinite().tolist() == [1, 1, 0, 0, 0]
    assert filter_logits(logits, 0, 1.0, 0.25).isfinite().tolist() == [1, 1, 1, 0, 0]
    assert filter_logits(logits, 0, 1.0, 1.0).isfinite().tolist() == [1, 0, 0, 0, 0]
    # top_p 0.8 alone keeps three; after min_p 0.25 the three renormalise to 0.588, 0.235,
    # 0.176: the mass before the third is 0.824 >= 0.8, so it goes
    assert filter_logits(logits, 0, 0.8).isfinite().tolist() == [1, 1, 1, 0, 0]
    assert filter_logits(logits, 0, 0.8, 0.25).isfinite().tolist() == [1, 1, 0, 0, 0]
    kept = filter_logits(logits, 0, 1.0, 0.25)
    assert kept[:3].tolist() == logits[:3].tolist()             # kept values unchanged


def test_min_p_applies_after_temperature():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    s = Sampler(seed=0)
    # temperature 2 takes square roots of the ratios: 0.63, 0.55, 0.45, 0.32; min_p 0.5
    # keeps tokens 0-2 (at temperature 1 it would keep token 0 alone: ratio 0.4 < 0.5)
    hot = SamplingParams(temperature=2.0, min_p=0.5)
    assert {s.sample(logits, [hot], [None])[0] for _ in range(300)} == {0, 1, 2}
    cold = SamplingParams(temperature=1.0, min_p=0.5)
    assert {s.sample(logits, [cold], [None])[0] for _ in range(50)} == {0}


def test_min_p_one_at_temperature_one_is_greedy():
    s = Sampler(seed=3)
    logits = torch.randn(20, 300, generator=torch.Generator().manual_seed(4))
    p = SamplingParams(temperature=1.0, min_p=1.0)
    assert s.sample(logits, [p] * 20, [None] * 20) == logits.argmax(-1).tolist()
