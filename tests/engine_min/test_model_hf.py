"""The real model (SmolLM2-135M-Instruct Q4_1 GGUF): engine_min's logits and tokenizer equal
transformers' loading the same GGUF (fp32), in prefill and over 10 decode steps."""
import os

import pytest
import torch

from engine_min.config import EngineConfig
from engine_min.engine import LLMEngine
from engine_min.sampler import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

PROMPTS = ["The quick brown fox jumps over the lazy dog. Once upon a time",
           "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
           "def add(a, b):\n    return"]


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(kv_cache_bytes=64 * 1024 * 1024))


@pytest.fixture(scope="module")
def hf(engine):
    folder, name = os.path.split(engine.model_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                              dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model.eval(), tok


def test_logits_match_transformers_prefill_and_10_decode_steps(engine, hf, monkeypatch):
    model, _ = hf
    captured = []
    execute = engine.runner.execute

    def spy(sched_out):
        ordered, logits = execute(sched_out)
        captured.append(logits.clone())
        return ordered, logits

    monkeypatch.setattr(engine.runner, "execute", spy)
    for prompt in PROMPTS:
        captured.clear()
        ids = engine.tokenizer.encode(prompt)
        out = engine.generate([ids], SamplingParams(max_tokens=11, ignore_eos=True))[0]
        ours = torch.cat(captured)                       # [11, vocab]: prefill + 10 decodes
        full = ids + out.output_token_ids[:10]
        with torch.no_grad():
            want = model(torch.tensor([full])).logits[0, len(ids) - 1:]   # [11, vocab]
        assert ours.shape == want.shape == (11, 49152)
        assert (ours - want).abs().max().item() < 1e-3, prompt
        assert out.output_token_ids == want.argmax(-1).tolist()


def test_tokenizer_and_chat_template_match_transformers(engine, hf):
    _, tok = hf
    texts = PROMPTS + ["Ünïcödé 日本語 🎉 café  x\t\n\nyear 1492, pi 3.14", "  leading spaces"]
    for text in texts:
        ids = engine.tokenizer.encode(text)
        assert ids == tok.encode(text, add_special_tokens=False), text
        assert engine.tokenizer.decode(ids, skip_special_tokens=False) == text
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    assert engine.tokenizer.apply_chat_template(msgs) == tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True)
    assert engine.tokenizer.eos_token_id == 2 == tok.convert_tokens_to_ids("<|im_end|>")


def test_whitespace_before_digits_follows_the_models_own_pre_tokenizer(engine, hf):
    """SmolLM2's tokenizer.json (and llama.cpp's "smollm" pre-tokenizer) split digits first,
    then byte-level: "a\n\n1" -> "a" "\n\n" "1". transformers' GGUF converter skips the
    digit split here and yields "\n" "\n"; engine_min follows the model's own tokenizer."""
    _, tok = hf
    assert engine.tokenizer.encode("a\n\n1") == [81, 1116, 33]
    assert engine.tokenizer.encode("x  12") == [104, 256, 33, 34]
    assert tok.encode("a\n\n1", add_special_tokens=False) == [81, 198, 198, 33]
