"""What the router reads on the side of the bytes it relays: ``cached_tokens`` of a stream's
usage chunk however the stream is cut into chunks, and an engine's load from its metrics."""
from __future__ import annotations

import json

from engine_min.router.usage import UsageScanner, cached_tokens
from engine_min.router.subscriber import parse_load

USAGE = {"prompt_tokens": 70, "completion_tokens": 3, "total_tokens": 73,
         "prompt_tokens_details": {"cached_tokens": 48}}
STREAM = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in (
    {"id": "c", "choices": [{"index": 0, "text": "cached_tokens", "finish_reason": None}],
     "usage": None},
    {"id": "c", "choices": [{"index": 0, "text": "!", "finish_reason": "length"}],
     "usage": None},
    {"id": "c", "choices": [], "usage": USAGE})) + b"data: [DONE]\n\n"


def test_usage_found_whatever_the_chunking():
    for size in (1, 7, 64, len(STREAM)):
        scanner = UsageScanner()
        for i in range(0, len(STREAM), size):
            scanner.feed(STREAM[i:i + size])
        assert scanner.cached_tokens == 48, size
    scanner = UsageScanner()
    scanner.feed(STREAM[:STREAM.index(b'{"id": "c", "choices": []')])  # no usage chunk
    assert scanner.cached_tokens is None
    assert cached_tokens({"usage": USAGE}) == 48
    assert cached_tokens({"usage": None}) is None and cached_tokens([]) is None


def test_load_from_engine_metrics():
    text = (b"# HELP engine_num_requests_running Requests running\n"
            b"# TYPE engine_num_requests_running gauge\n"
            b"engine_num_requests_running 3.0\n"
            b"engine_num_requests_running_extra 100.0\n"
            b'engine_num_requests_waiting{model="m"} 2.0\n'
            b"engine_prompt_tokens_total 900.0\n")
    assert parse_load(text) == 5
    assert parse_load(b"") == 0
