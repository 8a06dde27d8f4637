"""docs/router.md's statement: a shared system prompt that is most of each prompt, with requests
arriving one at a time (equal loads), sends every new chat to the engine that served the first,
without a store (reason ``hit``) and with one holding the system prompt (reason ``load``: the
least-loaded fallback prefers the engine holding the most itself), until its load exceeds the
least loaded engine's by more than ``max_load_gap``; a ``min_hit_fraction`` above S / n spreads
them."""
from engine_min.router.policy import HIT, LOAD, CacheAwarePolicy, Candidate
from engine_min.router.store_lookup import choose_with_store, store_can_change_pick

S, N = 64, 80   # system prompt (4 blocks of 16) and a new chat's prompt: S / N = 0.8


def _new_chats(policy, loads, store: bool) -> list[tuple[int, str]]:
    """Six new chats, one at a time; the engine picked holds S from then on."""
    held = {0: 0, 1: 0}
    out = []
    for _ in range(6):
        cands = [Candidate(p, held[p], loads[p]) for p in (0, 1)]
        if store and held[0] + held[1]:
            assert not store_can_change_pick(policy, cands, N)  # the lookup is skipped
            d = choose_with_store(policy, cands, {0: S, 1: S}, N)
        else:
            d = policy.choose(cands, N)
        held[d.position] = S
        out.append((d.position, d.reason))
    return out


def test_every_new_chat_goes_to_the_engine_holding_the_system_prompt():
    got = _new_chats(CacheAwarePolicy(), {0: 0, 1: 0}, store=False)
    assert got[0] == (0, LOAD) and got[1:] == [(0, HIT)] * 5
    # the store holding the system prompt: by load, and still the same engine
    assert [p for p, _ in _new_chats(CacheAwarePolicy(), {0: 0, 1: 0}, store=True)] == [0] * 6
    # engine 0 holding it: a load 8 above engine 1's (the gap) keeps the chat there, 9 does not
    for load, want in ((8, (0, HIT)), (9, (1, LOAD))):
        d = CacheAwarePolicy(max_load_gap=8).choose([Candidate(0, S, load), Candidate(1, 0, 0)],
                                                   N)
        assert (d.position, d.reason) == want, load


def test_a_min_hit_fraction_above_s_over_n_spreads_them():
    got = _new_chats(CacheAwarePolicy(min_hit_fraction=0.9), {0: 0, 1: 0}, store=False)
    assert [p for p, _ in got] == [0, 1, 0, 1, 0, 1] and {r for _, r in got} == {LOAD}
