"""``prepare_prompt`` on prompts of token ids (no tokenizer needed): its block hashes under
each engine's ``(hash_seed, block_size)`` are ``block_hashes`` of the ids exactly; ids the
engine refuses give no prompt; ``prompt_source`` is the text or ids the engine tokenizes."""
from __future__ import annotations

import json

from engine_min.block_hash import block_hashes
from engine_min.router.prompt import prepare_prompt, prompt_source, source_token_ids


def _body(ids) -> bytes:
    return json.dumps({"prompt": ids, "max_tokens": 1}).encode()


def test_hashes_per_key_equal_the_engines():
    ids = [7, 2**32 - 1, 0] + list(range(1000, 1077))      # 80 tokens: 5 blocks of 16
    a, b = (b"\x01" * 16, 16), (b"\x02" * 16, 32)
    p = prepare_prompt(None, _body(ids), "completion", [a, b, a])
    assert p.token_ids == ids and set(p.hashes) == {a, b}
    assert p.hashes[a] == block_hashes(a[0], ids, 16) and len(p.hashes[a]) == 5
    assert p.hashes[b] == block_hashes(b[0], ids, 32) and len(p.hashes[b]) == 2
    assert p.hashes[a][0] != p.hashes[b][0]
    # no engine index ready yet: the ids alone
    p = prepare_prompt(None, _body(ids), "completion", [])
    assert p.token_ids == ids and p.hashes == {}


def test_ids_the_engine_refuses_give_no_prompt():
    for bad in ([1, 2**32], [-1, 5], "not json"):
        raw = _body(bad) if bad != "not json" else b"{nope"
        p = prepare_prompt(None, raw, "completion", [(b"\x01" * 16, 16)])
        assert p.token_ids is None and p.hashes == {}


def test_prompt_source_is_what_the_engine_tokenizes():
    assert prompt_source(None, _body([5, 6]), "completion") == [5, 6]
    assert prompt_source(None, b'{"prompt": "Hi there"}', "completion") == "Hi there"
    assert prompt_source(None, b'{"prompt": "x", "n": 2}', "completion") is None
    assert prompt_source(None, b"{nope", "chat") is None
    assert source_token_ids(None, None) is None and source_token_ids(None, [3]) == [3]
