"""The router's routing, end to end: its token ids equal an engine's own ``/tokenize`` (an
engine in another process, which loaded its own tokenizer; chat template, the piece cache, the
start-up probe); two users' chats start on different engines and each later round goes back to
the engine holding its history, with the index's predicted hit tokens equal to the engine's
reported ``cached_tokens`` request by request."""
from __future__ import annotations

import json

from engine_min.router.cli import check_tokenizer
from engine_min.router.prompt import PromptEncoder, prompt_token_ids
from engine_min.serve.protocol import parse_messages
from tests.engine_min.router.served import (BS, MODEL, free_port, metric, metrics, post_json,
                                            settle, wait_health)


def test_token_ids_equal_an_engine_tokenize(engines, spare):
    proc, url = spare
    wait_health(url, proc)
    tok = engines[0].engine.tokenizer
    prompt = "Route me: 12345 <|im_start|>  tabs\tand émojis 🚀"
    body = json.dumps({"model": MODEL, "prompt": prompt}).encode()
    ids = prompt_token_ids(tok, body, "completion")
    assert ids == post_json(url, "/tokenize", {"prompt": prompt})["tokens"]
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Capital of "},
                                             {"type": "text", "text": "France?"}]},
                {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "And of Italy?"}]
    ids = prompt_token_ids(tok, json.dumps({"messages": messages}).encode(), "chat")
    expected = post_json(url, "/tokenize", {"messages": messages})["tokens"]
    assert ids == expected and len(ids) > 30
    assert prompt_token_ids(tok, b'{"prompt": [[5, 6, 7]]}', "completion") == [5, 6, 7]
    # the router's encoder (cached pieces between special tokens) gives the tokenizer's ids
    enc = PromptEncoder(tok, max_cached_chars=40)
    rendered = tok.apply_chat_template(parse_messages({"messages": messages}))
    for text in (rendered, rendered, prompt, "a<|im_start|>b<|im_end|>", " <|im_end|> 1 2 ",
                 "<|im_start", "", "x" * 50 + "<|endoftext|>\n\n"):
        assert enc.encode(text) == tok.encode(text), text
    assert enc._chars <= 40 and enc._split is not None
    # what a prompt would cost to tokenize: the text between special tokens not cached yet
    enc = PromptEncoder(tok)
    assert enc.num_uncached_chars(rendered) == len(rendered.replace("<|im_start|>", "")
                                                   .replace("<|im_end|>", "")) > 50
    enc.encode(rendered)
    assert enc.num_uncached_chars(rendered) == 0
    assert enc.num_uncached_chars(rendered + "<|im_start|>user\nNew?") == len("user\nNew?")
    assert prompt_token_ids(tok, json.dumps({"messages": messages}).encode(), "chat",
                            enc) == expected
    # the start-up probe agrees with the engine; a dead engine and another tokenizer are named
    assert check_tokenizer([url], tok) == []
    dead = f"http://127.0.0.1:{free_port()}"
    (warning,) = check_tokenizer([dead], tok)
    assert warning.startswith(f"{dead}: cannot compare tokenizers")

    class Shifted:  # a tokenizer whose ids differ from the engine's
        def __getattr__(self, name):
            return getattr(tok, name)

        def encode(self, text):
            return [t + 1 for t in tok.encode(text)]
    (warning,) = check_tokenizer([url], Shifted())
    assert warning.startswith(f"{url} tokenizes a chat differently from --model")
    # bodies the engine refuses: the router does not tokenize them
    for raw, kind in ((b"{nope", "chat"), (b'{"messages": []}', "chat"),
                      (b'{"prompt": "x", "n": 2}', "completion"), (b"[1]", "completion")):
        assert prompt_token_ids(tok, raw, kind) is None


def _chat_round(router, messages) -> tuple[str, dict]:
    out = post_json(router.url, "/v1/chat/completions",
                     {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0})
    return out["choices"][0]["message"]["content"], out["usage"]


def test_chat_rounds_go_to_the_engine_holding_the_history(router, engines):
    urls = [e.url for e in engines]
    users = {"A": [{"role": "user", "content": "Describe the harbour of Marseille, its old "
                                               "port and its fishing boats, in some detail."}],
             "B": [{"role": "user", "content": "List three facts about the planet Jupiter's "
                                               "moons Io and Europa, and their orbits."}]}
    placed: dict[str, list[tuple[str, str]]] = {"A": [], "B": []}
    prev_prompt_tokens: dict[str, int] = {}
    for rnd in range(3):
        for user, messages in users.items():
            settle(router, engines)
            before = [metrics(u) for u in urls]
            rbefore = metrics(router.url)
            text, usage = _chat_round(router, messages)
            settle(router, engines)
            rafter = metrics(router.url)
            after = [metrics(u) for u in urls]
            (where, reason), = [(u, r) for u in urls for r in ("hit", "load")
                                if metric(rafter, "router_requests_total", engine=u, reason=r)
                                > metric(rbefore, "router_requests_total", engine=u, reason=r)]
            placed[user].append((where, reason))
            predicted = (metric(rafter, "router_predicted_hit_tokens_total", engine=where)
                         - metric(rbefore, "router_predicted_hit_tokens_total", engine=where))
            reported = (metric(rafter, "router_reported_cached_tokens_total", engine=where)
                        - metric(rbefore, "router_reported_cached_tokens_total", engine=where))
            i = urls.index(where)
            engine_hits = (metric(after[i], "engine_prefix_cache_hits_total")
                           - metric(before[i], "engine_prefix_cache_hits_total"))
            # the index predicted exactly what the engine found, and the engine counted it
            assert predicted == reported == usage["prompt_tokens_details"]["cached_tokens"]
            assert engine_hits == reported
            if rnd > 0:  # a later round: the previous round's whole prompt was held
                assert reported >= prev_prompt_tokens[user] // BS * BS > 0, (usage, rnd)
            prev_prompt_tokens[user] = usage["prompt_tokens"]
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": f"Go on, part {rnd + 2}."}]
    # round 1 of each user: nothing worth a hit (at most a shared system-prompt block), so by
    # load, round-robin: the users start on different engines; rounds 2 and 3 follow by hit
    assert [r for _, r in placed["A"]] == [r for _, r in placed["B"]] == ["load", "hit", "hit"]
    assert placed["A"][0][0] != placed["B"][0][0]
    for user in users:
        assert {w for w, _ in placed[user]} == {placed[user][0][0]}
    m = metrics(router.url)
    assert m["router_failed_requests_total"] == 0
    for u in urls:
        assert metric(m, "router_engine_healthy", engine=u) == 1
        assert metric(m, "router_index_blocks", engine=u) == len(
            router.router.engines[urls.index(u)].index.blocks) > 0
