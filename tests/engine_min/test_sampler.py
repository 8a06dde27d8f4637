"""SamplingParams validation and the sampler's filters (exact); tiny temperatures are greedy,
any accepted params sample a kept token, and a bad row fails alone."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_min.sampler import SAMPLING_EPS, Sampler, SamplingParams, filter_logits


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


# ---- tiny temperatures and numerics ---------------------------------------------------------
@pytest.mark.parametrize("t, greedy", [(0.0, True), (1e-45, True), (1e-40, True), (1e-38, True),
                                       (9.99e-6, True), (1e-5, False), (0.7, False)])
def test_below_sampling_eps_is_greedy(t, greedy):
    assert SAMPLING_EPS == 1e-5 and SamplingParams(temperature=t).greedy is greedy


@pytest.mark.parametrize("t", [float("inf"), float("nan"), -1e-40, True])
def test_non_finite_or_negative_temperature_is_refused(t):
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        SamplingParams(temperature=t)


def test_tiny_temperature_picks_argmax_and_draws_nothing():
    # the input: temperature 1e-40 divided raw logits into inf, softmax gave NaN and
    # torch.multinomial raised "probability tensor contains either inf, nan or element < 0"
    s = Sampler(seed=0)
    logits = torch.tensor([[2.0, 31.5, -8.0, 31.25], [0.0, -1.0, 4.0, 3.9]])
    state = s.generator.get_state()
    for t in (1e-40, 1e-38, 1e-45):
        p = SamplingParams(temperature=t, top_k=2, top_p=0.5)
        assert s.sample(logits, [p, SamplingParams(temperature=0.8)], [None, None])[0] == 1
        assert s.sample(logits, [p, p], [None, None]) == [1, 2]
    assert not torch.equal(s.generator.get_state(), state)   # only the 0.8 row drew
    state = s.generator.get_state()
    s.sample(logits, [SamplingParams(temperature=1e-40)] * 2, [None, None])
    assert torch.equal(s.generator.get_state(), state)


def test_a_bad_row_fails_alone_and_the_others_draw_as_alone():
    s = Sampler(seed=0)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    logits[1, 7] = float("nan")
    seeded = SamplingParams(temperature=1.0, seed=9)
    alone = s.sample(logits[2:], [seeded], [torch.Generator().manual_seed(9)])[0]
    out = s.sample_rows(logits, [SamplingParams(), SamplingParams(), seeded],
                        [None, None, torch.Generator().manual_seed(9)])
    assert out[0] == int(logits[0].argmax()) and out[2] == alone
    assert isinstance(out[1], ValueError) and "1 NaN and 0 infinite values of 50" in str(out[1])
    with pytest.raises(ValueError, match="1 NaN"):
        s.sample(logits, [SamplingParams()] * 3, [None] * 3)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_any_accepted_params_sample_a_kept_token(data):
    vocab = data.draw(st.integers(1, 40))
    big = st.floats(allow_nan=False, allow_infinity=False, width=32)  # up to +-3.4e38
    row = torch.tensor(data.draw(st.lists(st.one_of(big, st.sampled_from([0.0, 1.0, -1.0])),
                                          min_size=vocab, max_size=vocab)), dtype=torch.float32)
    t = data.draw(st.one_of(st.floats(0, 1e-4), st.floats(0, 1e308), st.just(1.7e308)))
    top_k = data.draw(st.integers(0, vocab + 3))
    top_p = data.draw(st.one_of(st.floats(1e-300, 1.0, exclude_min=False), st.just(1.0)))
    min_p = data.draw(st.one_of(st.just(0.0), st.floats(0, 1)))
    p = SamplingParams(temperature=t, top_k=top_k, top_p=top_p, min_p=min_p)
    tok = Sampler(seed=data.draw(st.integers(0, 2**32))).sample(row[None], [p], [None])[0]
    assert 0 <= tok < vocab
    if not p.greedy:                                    # min_p: a kept token's ratio to the top
        r = row.double()
        assert math.exp((r[tok] - r.max()) / t) >= min_p
    if p.greedy or top_k == 1:
        assert row[tok] == row.max()
    if 0 < top_k < vocab:                               # a token of the top k
        assert row[tok] >= torch.topk(row, top_k).values[-1]
