"""A JSON call to a test server (``server.url``): the status and the decoded answer, errors
included (an HTTP error's body is the OpenAI-style error object)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request


def call_json(server, path: str, body: dict | None = None) -> tuple[int, dict]:
    """GET ``path`` (``body`` None) or POST ``body`` as JSON; returns ``(status, answer)``.
    Raises what urllib raises for anything but an HTTP error status (120 s timeout)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data,
                                 method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
