"""bench.long_doc_qa_layerwise on the real model, small: a 600-token document, 2 rounds. Both
modes answer what the engine answers without a store, load the same tokens per hit (every
prompt was run once before, so its 608 tokens are stored: 2 chunks of 256 and 6 pieces of 16; a
hit loads all but the last token), never fall back, and the figures are there."""
from __future__ import annotations

import json

from bench.long_doc_qa_layerwise import MODES, main


def test_both_modes_answer_alike_and_load_the_same_tokens(tmp_path):
    out = tmp_path / "lw.json"
    res = main(["--doc-tokens", "600", "--question-tokens", "8", "--rounds", "2",
                "--json", str(out)])
    assert json.loads(out.read_text())["rounds"] == 2
    assert res["outputs_identical"] is True
    whole, layerwise = (res[m] for m in MODES)
    # each of the 2 hits per mode loads 600 + 8 - 1 tokens
    assert whole["loaded_tokens"] == layerwise["loaded_tokens"] == 2 * 607
    assert whole["fallbacks"] == layerwise["fallbacks"] == 0
    assert len(whole["ttft_hit_runs_s"]) == len(layerwise["ttft_hit_runs_s"]) == 2
    assert res["layerwise_over_whole"] > 0 and len(res["load_average"]) == 2
