"""Async streaming client for OpenAI-compatible servers, measuring latency as a user sees it.

For each request it records, on the client's clock (``time.perf_counter``):

    send ──── first token ── token ── token ── ... ── last token / [DONE]
    |<- TTFT ->|<- ITL ->|<- ITL ->|
    |<------------------------- E2E ------------------------------>|

TPOT is ``(E2E - TTFT) / (output_tokens - 1)``. Token events are the SSE chunks that carry text
(one per token in vLLM-style servers); the output token count comes from the final ``usage``
chunk when the server sends one (``stream_options.include_usage``), else from the events.
The client is deliberately light (one aiohttp session, no per-token work beyond a JSON parse)
because it shares the CPU with the server under test.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import aiohttp

from bench.workloads import Request


@dataclass
class RequestResult:
    """Client-side measurements of one request (seconds; ``None`` where not measured).

    ``send_s`` is relative to the start of the run. ``num_cached_tokens`` is the server's
    ``usage.prompt_tokens_details.cached_tokens`` (reused prompt tokens), ``None`` if absent.
    ``text`` is the streamed output (compared across configurations: reuse must not change it);
    ``token_ids`` its token ids when the client asked for them (``return_token_ids``) and the
    server sent them in every chunk (``None`` otherwise).
    """

    request_id: str
    session: str
    index: int
    base_url: str
    ok: bool = False
    error: str | None = None
    send_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    num_prompt_tokens: int | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int | None = None
    text: str = ""
    token_ids: list[int] | None = None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first, ``None`` with fewer than 2 tokens."""
        if self.ttft_s is None or self.e2e_s is None or self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tpot_s"] = self.tpot_s
        return d


def build_payload(req: Request, model: str, endpoint: str, temperature: float = 0.0) -> dict:
    """The JSON body for ``req``: greedy, streaming with usage, exactly ``max_tokens`` tokens.

    ``endpoint`` is ``"completions"`` (prompt as token ids or text) or ``"chat"`` (text only,
    one user message).

    Raises:
        ValueError: token-id prompts on the chat endpoint, or an unknown endpoint.
    """
    body = {"model": model, "max_tokens": req.max_tokens, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    if endpoint == "completions":
        body["prompt"] = list(req.prompt) if isinstance(req.prompt, tuple) else req.prompt
    elif endpoint == "chat":
        if not isinstance(req.prompt, str):
            raise ValueError("the chat endpoint needs text prompts (use --prompt-format text)")
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        raise ValueError(f"endpoint must be 'completions' or 'chat', got {endpoint!r}")
    return body


def _token_text(chunk: dict, endpoint: str) -> str | None:
    """Text carried by one SSE chunk, or ``None`` if the chunk is not a token event."""
    choices = chunk.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        text = delta.get("content")
        if text is None or (text == "" and "role" in delta):
            return None
    else:
        text = choice.get("text")
        if text is None:
            return None
    if text == "" and choice.get("finish_reason") is not None:
        return None  # a closing chunk that only carries the finish reason
    return text


class StreamingClient:
    """Sends ``Request``s to one OpenAI-compatible server and measures them.

    Args:
        session: a shared ``aiohttp.ClientSession`` (the caller owns and closes it).
        base_url: e.g. ``"http://127.0.0.1:8000"`` (without ``/v1``).
        model: model name sent in each body.
        endpoint: ``"completions"`` or ``"chat"``.
        timeout_s: per-request limit; a request past it is recorded as failed.
        return_token_ids: ask for the output's token ids too (vLLM's and ``engine_min
            serve``'s ``return_token_ids``), kept in ``RequestResult.token_ids``.
    """

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str,
                 endpoint: str = "completions", timeout_s: float = 600.0,
                 return_token_ids: bool = False):
        self.session = session
        self.return_token_ids = return_token_ids
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.endpoint = endpoint
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
        self.url = self.base_url + path

    async def send(self, req: Request, run_start: float) -> RequestResult:
        """Send ``req`` now and stream the answer. Never raises for server or network errors:
        they are recorded in ``RequestResult.error``."""
        res = RequestResult(req.request_id, req.session, req.index, self.base_url,
                            num_prompt_tokens=req.num_prompt_tokens)
        body = build_payload(req, self.model, self.endpoint)
        if self.return_token_ids:
            body["return_token_ids"] = True
            res.token_ids = []
        t_send = time.perf_counter()
        res.send_s = t_send - run_start
        last = None
        try:
            async with self.session.post(self.url, json=body, timeout=self.timeout) as resp:
                if resp.status != 200:
                    res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                    return res
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    now = time.perf_counter()
                    if "error" in chunk:
                        res.error = str(chunk["error"])[:300]
                        return res
                    if res.token_ids is not None and chunk.get("choices"):
                        ids = chunk["choices"][0].get("token_ids")
                        if ids is None:  # (a server without the extension)
                            res.token_ids = None
                        else:
                            res.token_ids.extend(ids)
                    text = _token_text(chunk, self.endpoint)
                    if text is not None:
                        res.text += text
                        if last is None:
                            res.ttft_s = now - t_send
                        else:
                            res.itl_s.append(now - last)
                        last = now
                        res.num_output_tokens += 1
                    usage = chunk.get("usage")
                    if usage:
                        self._read_usage(res, usage)
            res.e2e_s = time.perf_counter() - t_send
            res.ok = res.ttft_s is not None
            if not res.ok:
                res.error = "stream ended without a token"
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, ValueError) as e:
            res.error = f"{type(e).__name__}: {e}"[:300]
        return res

    @staticmethod
    def _read_usage(res: RequestResult, usage: dict) -> None:
        if usage.get("prompt_tokens") is not None:
            res.num_prompt_tokens = int(usage["prompt_tokens"])
        if usage.get("completion_tokens") is not None:
            res.num_output_tokens = int(usage["completion_tokens"])
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            res.num_cached_tokens = int(details["cached_tokens"])


async def first_model(session: aiohttp.ClientSession, base_url: str, default: str = "default"
                      ) -> str:
    """The id of the first model ``GET /v1/models`` lists, or ``default`` if it lists none or
    the call fails."""
    try:
        async with session.get(base_url.rstrip("/") + "/v1/models",
                               timeout=aiohttp.ClientTimeout(total=10)) as resp:
            if resp.status == 200:
                data = (await resp.json()).get("data") or []
                if data and data[0].get("id"):
                    return str(data[0]["id"])
    except (aiohttp.ClientError, TimeoutError, ValueError):
        pass
    return default
