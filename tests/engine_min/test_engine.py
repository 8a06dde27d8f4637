"""LLMEngine end to end on the real model (greedy, exact token ids): chat answer, continuous
batching == alone, prefix caching, preemption under a tiny pool, bad input, stopping rules."""
import pytest

from engine_min.config import EngineConfig
from engine_min.engine import LLMEngine
from engine_min.sampler import SamplingParams
from tests.engine_min.null_connector import NullConnector

PROMPTS = ["The capital of Germany is", "Once upon a time, there was a", "def fibonacci(n):",
           "The best way to learn physics is", "List three colors:", "Water boils at",
           "My favourite animal is the", "In 1492, Columbus"]
BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4          # one KV block of SmolLM2-135M in fp32


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, **kw)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(kv_cache_bytes=128 * 1024 * 1024))


@pytest.fixture(scope="module")
def alone(engine):
    """Greedy 8-token outputs of PROMPTS, each run alone."""
    return [engine.generate([p], greedy(8))[0].output_token_ids for p in PROMPTS]


def test_chat_capital_of_france(engine):
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}])
    out = engine.generate([prompt], greedy(20))[0]
    assert "Paris" in out.text
    assert out.finished and out.finish_reason == "stop" and out.output_token_ids[-1] == 2
    assert out.first_token_time >= out.arrival_time


def test_batch_of_8_equals_each_alone(engine, alone):
    outs = engine.generate(PROMPTS, greedy(8))
    assert [o.output_token_ids for o in outs] == alone
    assert all(o.finish_reason == "length" and len(o.output_token_ids) == 8 for o in outs)
    engine.block_manager.check_integrity()
    assert engine.stats()["kv_blocks_used"] == 0


def test_prefix_cache_hit_same_output_fewer_computed_tokens(engine):
    shared = engine.tokenizer.encode("You are a careful assistant. Answer briefly. " * 8)[:48]
    assert len(shared) == 48                                              # 3 full blocks
    cold_ids = shared + engine.tokenizer.encode(" Tell me about the moon.")
    s0 = engine.stats()
    cold = engine.generate([cold_ids], greedy(6))[0]
    s1 = engine.stats()
    warm = engine.generate([shared + engine.tokenizer.encode(" Tell me about the moon.")],
                           greedy(6))[0]
    s2 = engine.stats()
    assert warm.output_token_ids == cold.output_token_ids
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens == 48   # 3 full blocks hit
    assert s1["prefix_cache_hits_tokens"] - s0["prefix_cache_hits_tokens"] == 0
    assert s2["prefix_cache_hits_tokens"] - s1["prefix_cache_hits_tokens"] == 48
    assert s2["prefix_cache_queries_tokens"] - s1["prefix_cache_queries_tokens"] == len(cold_ids)


def test_fully_cached_prompt_recomputes_only_last_token(engine):
    ids = engine.tokenizer.encode("Counting: one two three four five six seven eight nine ten "
                                  "eleven twelve thirteen fourteen fifteen sixteen " * 2)[:32]
    assert len(ids) == 32                                                 # 2 full blocks
    first = engine.generate([ids], greedy(5))[0]
    s = engine.stats()
    again = engine.generate([ids], greedy(5))[0]
    assert again.output_token_ids == first.output_token_ids
    assert again.num_cached_tokens == 31
    assert engine.stats()["prefix_cache_hits_tokens"] - s["prefix_cache_hits_tokens"] == 31
    engine.block_manager.check_integrity()


def test_preemption_under_tiny_pool_same_outputs(alone):
    # 8-token blocks, 6 usable: 6 requests start with one block each, then need a second one
    small = LLMEngine(EngineConfig(block_size=8, kv_cache_bytes=BLOCK_BYTES // 2 * 7,
                                   max_num_batched_tokens=64, enable_prefix_caching=False))
    assert small.stats()["kv_blocks_total"] == 6 and small.stats()["kv_pool_bytes"] == BLOCK_BYTES // 2 * 7
    outs = small.generate(PROMPTS, greedy(8))
    assert [o.output_token_ids for o in outs] == alone
    assert small.stats()["num_preemptions"] > 0, small.stats()
    small.block_manager.check_integrity()


@pytest.mark.parametrize("prompt, sampling, msg", [
    ("", None, "prompt is empty"),
    ([], None, "prompt is empty"),
    ([1, 2, 49152], None, "outside \\[0, 49152\\)"),
    ([5, -1], None, "outside"),
    ([7] * 8193, None, "prompt has 8193 tokens; max_model_len is 2896"),  # > model context too
    ("hi", "not params", "SamplingParams"),
])
def test_bad_input_raises_and_engine_keeps_serving(engine, alone, prompt, sampling, msg):
    rid = engine.add_request(PROMPTS[0], greedy(8))
    with pytest.raises(ValueError, match=msg):
        engine.add_request(prompt, sampling)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(done) == [rid] and done[rid].output_token_ids == alone[0]


def test_duplicate_request_id_and_abort(engine):
    rid = engine.add_request(PROMPTS[1], greedy(50), request_id="x")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(PROMPTS[2], greedy(5), request_id="x")
    engine.step()
    assert engine.stats()["kv_blocks_used"] > 0
    assert engine.abort(rid) and not engine.abort(rid)
    outs = engine.step()
    assert [(o.request_id, o.finish_reason, o.finished) for o in outs] == [("x", "abort", True)]
    assert not engine.has_unfinished() and engine.stats()["kv_blocks_used"] == 0


def test_stop_rules(engine, alone):
    base = alone[1]                                            # "Once upon a time, there was a"
    text = engine.tokenizer.decode(base)
    by_id = engine.generate([PROMPTS[1]], greedy(8, stop_token_ids=[base[2]]))[0]
    assert by_id.output_token_ids == base[:3] and by_id.finish_reason == "stop"
    word = text.split()[1]
    by_str = engine.generate([PROMPTS[1]], greedy(8, stop=[word]))[0]
    assert by_str.finish_reason == "stop" and by_str.text == text[:text.index(word)]
    chat = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}])
    free = engine.generate([chat], greedy(40, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.output_token_ids) == 40


def test_seeded_sampling_is_reproducible_across_batches(engine):
    sp = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, top_k=50, seed=1234)
    one = engine.generate([PROMPTS[3]], sp)[0].output_token_ids
    both = engine.generate([PROMPTS[3], PROMPTS[4]], [sp, sp])
    assert both[0].output_token_ids == one


def test_step_outputs_stream_tokens(engine, alone):
    rid = engine.add_request(PROMPTS[2], greedy(8))
    seen = []
    while engine.has_unfinished():
        for o in engine.step():
            seen += o.new_token_ids
            last = o
    assert seen == alone[2] == last.output_token_ids and last.request_id == rid


def test_cli_reports_a_missing_model(capsys):
    from engine_min.cli import main
    assert main(["generate", "--prompt", "hi", "--model", "/no/such/model.gguf"]) == 2
    assert "model path does not exist: /no/such/model.gguf" in capsys.readouterr().err


class RecordingConnector(NullConnector):
    """Records register_model and register_kv_caches; reports no external hits (the engine's
    seams still run)."""

    def __init__(self):
        self.registered = self.identity = None

    def register_model(self, identity):
        assert self.registered is None, "register_model comes before register_kv_caches"
        self.identity = identity

    def register_kv_caches(self, kv_cache, block_size):
        self.registered = (kv_cache, block_size)

    def get_stats(self):
        return {"external_prefix_cache_queries": 0}


def test_set_connector_binds_all_seams_and_refuses_mid_request(engine, alone):
    conn = RecordingConnector()
    rid = engine.add_request(PROMPTS[0], greedy(8))
    with pytest.raises(RuntimeError, match="unfinished"):
        engine.set_connector(conn)
    assert engine.connector is None and conn.registered is None     # nothing changed
    engine.abort(rid)
    engine.step()
    engine.set_connector(conn)
    assert engine.connector is engine.scheduler.connector is engine.runner.connector is conn
    assert conn.registered[0] is engine.kv_cache and conn.registered[1] == 16
    assert conn.identity == engine.kv_identity
    assert engine.stats()["external_prefix_cache_queries"] == 0
    assert engine.generate([PROMPTS[0]], greedy(8))[0].output_token_ids == alone[0]
    engine.set_connector(None)
    assert engine.connector is engine.scheduler.connector is engine.runner.connector is None
