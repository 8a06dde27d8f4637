"""Workload generators: exact seeded values, the prefix structure each workload promises,
and clear errors for bad sizes."""
import pytest

from bench.workloads import (TOKEN_HIGH, TOKEN_LOW, WORDS, LongDocQA, MultiRoundQA, Request,
                             first_in_session)

SMALL_CHAT = dict(num_users=2, num_rounds=3, system_tokens=4, context_tokens=3,
                  question_tokens=2, answer_tokens=2, qps=2.0, seed=1)


def test_multi_round_exact_values():
    reqs = MultiRoundQA(**SMALL_CHAT).requests()
    assert [r.request_id for r in reqs] == ["u0-r0", "u1-r0", "u0-r1", "u1-r1", "u0-r2", "u1-r2"]
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    assert [r.after for r in reqs] == [None, None, "u0-r0", "u1-r0", "u0-r1", "u1-r1"]
    assert reqs[0].prompt == (19454, 20961, 30451, 38068, 21232, 13943, 15125, 26087, 18488)
    assert reqs[1].prompt == (19454, 20961, 30451, 38068, 15111, 31769, 25787, 25497, 36942)
    assert reqs[4].prompt == (19454, 20961, 30451, 38068, 21232, 13943, 15125, 26087, 18488,
                              18405, 1548, 33107, 9014, 37593, 11272, 38312, 10034)
    assert all(r.max_tokens == 2 for r in reqs)


def test_multi_round_history_structure():
    wl = MultiRoundQA(**SMALL_CHAT)
    reqs = wl.requests()
    by_id = {r.request_id: r for r in reqs}
    # every user shares the 4-token system prompt, then has its own context
    assert {r.prompt[:4] for r in reqs} == {reqs[0].prompt[:4]}
    assert reqs[0].prompt[4:7] != reqs[1].prompt[4:7]
    for r in reqs:
        # round r = system 4 + context 3 + r * (question 2 + answer 2) + question 2
        assert len(r.prompt) == 4 + 3 + r.index * 4 + 2
        if r.after:
            prev = by_id[r.after].prompt
            assert r.prompt[:len(prev)] == prev  # whole history, then answer + new question
        assert all(TOKEN_LOW <= t < TOKEN_HIGH for t in r.prompt)
    assert wl.working_set_tokens == 4 + 2 * (3 + 3 * 4)


def test_generators_are_deterministic_and_seeded():
    assert MultiRoundQA(**SMALL_CHAT).requests() == MultiRoundQA(**SMALL_CHAT).requests()
    other = MultiRoundQA(**{**SMALL_CHAT, "seed": 2}).requests()
    assert other[0].prompt != MultiRoundQA(**SMALL_CHAT).requests()[0].prompt
    # more users leave the first users' prompts unchanged (independent streams)
    more = MultiRoundQA(**{**SMALL_CHAT, "num_users": 3}).requests()
    assert more[0].prompt == MultiRoundQA(**SMALL_CHAT).requests()[0].prompt


def test_long_doc_shuffled_exact_values():
    reqs = LongDocQA(num_docs=2, doc_tokens=5, questions_per_doc=2, question_tokens=2,
                     answer_tokens=3, order="shuffled", seed=3).requests()
    assert [r.request_id for r in reqs] == ["d0-q1", "d1-q0", "d1-q1", "d0-q0"]
    assert reqs[0].prompt == (3627, 31020, 17739, 14156, 6050, 1084, 14191)
    assert reqs[3].prompt == (3627, 31020, 17739, 14156, 6050, 14332, 9105)
    assert reqs[1].prompt[:5] == reqs[2].prompt[:5] == (9718, 28072, 32029, 31172, 37743)
    assert all(r.max_tokens == 3 and r.arrival_s == 0.0 for r in reqs)
    assert first_in_session(reqs) == {"d0-q1", "d1-q0"}


def test_long_doc_interleaved_order():
    reqs = LongDocQA(num_docs=3, doc_tokens=8, questions_per_doc=2).requests()
    assert [r.request_id for r in reqs] == ["d0-q0", "d1-q0", "d2-q0", "d0-q1", "d1-q1",
                                            "d2-q1"]
    assert reqs[0].prompt[:8] == reqs[3].prompt[:8] != reqs[1].prompt[:8]


def test_text_format_uses_word_list():
    reqs = MultiRoundQA(num_users=1, num_rounds=2, system_tokens=0, context_tokens=0,
                        question_tokens=3, answer_tokens=1, prompt_format="text").requests()
    assert reqs[0].prompt == " station from only"
    assert reqs[1].prompt == " station from only down each evening know"
    assert all(w in WORDS for w in reqs[1].prompt.split())
    assert reqs[0].num_prompt_tokens is None


@pytest.mark.parametrize("kwargs, match", [
    ({"num_users": 0}, "num_users"), ({"qps": 0}, "qps"), ({"answer_tokens": -1}, "answer"),
    ({"context_tokens": -5}, "context_tokens"), ({"prompt_format": "bytes"}, "prompt_format"),
])
def test_multi_round_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MultiRoundQA(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"doc_tokens": 0}, "doc_tokens"), ({"order": "random"}, "order"),
    ({"max_inflight": 0}, "max_inflight"),
])
def test_long_doc_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LongDocQA(**kwargs)


def test_request_prompt_length():
    assert Request("a", 0.0, (1, 2, 3), 1, "s", 0).num_prompt_tokens == 3
