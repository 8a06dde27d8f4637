"""EngineMinConnector demotes the tail pieces a request saved once its answer fills their chunk
(real model, SmolLM2-135M; the document questions of ``test_connector_tail``: C = 16, F = 4,
a 152-token document + 6-token questions, 5 tokens generated).

q1 saves chunks [0, 144), then pieces 36, 37, 38 ([144, 156)) at the end of its prompt, then at
its end (162 tokens with KV) its chunk [144, 160), which covers those pieces: the writer
demotes the three. q2..q4 still load the document's pieces 36, 37 (152 tokens: the same hits
as without demotion), which lifts their demotion; each saves its own piece 38 (question
tokens) and its own chunk [144, 160), which demotes that piece only: pieces a request merely
loaded are left alone. Greedy outputs equal the engine's without a connector.
"""
from __future__ import annotations

from tests.connectors.test_connector_tail import DOC, F, connector, doc_qa
from tests.connectors.test_connector_tail import engine, prompts  # noqa: F401  (fixtures)


def test_answer_filling_the_chunk_demotes_its_pieces_and_the_next_question_still_hits(
        engine, prompts):  # noqa: F811
    conn = connector(F)
    cached, st = doc_qa(engine, prompts, conn)          # (asserts outputs equal no store)
    assert cached == [0, DOC, DOC, DOC]                 # 152: pieces 36, 37 still serve
    assert st["kvstore_loaded_tail_chunks"] == 3 * 2
    assert st["kvstore_demoted_tail_chunks"] == 3 + 3 and st["kvstore_demote_errors"] == 0
    store = conn.store
    assert store.stats()["demoted_chunks"] == 6
    assert store.metrics.registry.get_sample_value("kvstore_demoted_chunks_total") == 6
    cpu = store.tiers[0]
    doc_pieces = conn.tail_ns.chunk_keys(prompts["doc"])[36:38]
    own = [conn.tail_ns.chunk_keys(prompts["doc"] + q)[38] for q in prompts["qs"]]
    assert [cpu.is_demoted(k) for k in doc_pieces] == [False, False]   # read again: lifted
    assert [cpu.is_demoted(k) for k in own] == [True] * 4
    assert cpu.policy.num_demoted == 4
    assert store.exists(conn.tail_ns, doc_pieces + own) == [True] * 6  # room: all stay
    store.check_integrity()
    conn.close()


def test_without_a_chunk_past_the_pieces_nothing_is_demoted(engine, prompts):  # noqa: F811
    """Tail pieces off: chunks are saved as before and no demote call is made."""
    conn = connector(0)
    cached, st = doc_qa(engine, prompts, conn)
    assert cached == [0, 144, 144, 144]
    assert st["kvstore_demoted_tail_chunks"] == 0 and conn.store.stats()["demoted_chunks"] == 0
    conn.close()
