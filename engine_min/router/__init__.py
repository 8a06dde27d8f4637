"""The cache-aware router: ``python -m engine_min route --engines URL,URL,...`` (``cli``).

Files: ``index`` (an engine's cached block hashes from its KV events), ``subscriber`` (health,
load and events loops per engine), ``prompt`` (a request's token ids and block hashes, as the
engine computes them), ``policy`` (round-robin, cache-aware), ``proxy`` (the aiohttp app),
``metrics`` (its Prometheus series).
"""
