"""engine_min's model vs transformers on tiny random safetensors folders: RoPE scaling types
(default, linear, llama3, yarn), GQA, untied LM head, Qwen2 q/k/v bias; plus load errors."""
import json

import pytest
import torch

from engine_min.model import AttentionMetadata, LlamaModel, PrefillSpan
from engine_min.weights import ModelLoadError, load_model

transformers = pytest.importorskip("transformers")

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 500000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
             "rope_theta": 10000.0},
}
SIZES = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def engine_logits(path, ids, split=None):
    """All-position logits of one sequence through the paged path (block size 4), prefilled
    in two chunks at ``split`` (second chunk attends to the cached first)."""
    cfg, sd = load_model(str(path))
    model = LlamaModel(cfg, sd)
    kv = torch.zeros(cfg.num_layers, 2, 16, 4, cfg.num_kv_heads, cfg.head_dim)
    table = torch.arange(1, 16)
    outs = []
    for a, b in ([(0, len(ids))] if split is None else [(0, split), (split, len(ids))]):
        pos = torch.arange(a, b)
        meta = AttentionMetadata(slot_mapping=table[pos // 4] * 4 + pos % 4,
                                 prefills=[PrefillSpan(0, b - a, table, b)])
        with torch.inference_mode():
            outs.append(model.compute_logits(model(torch.tensor(ids[a:b]), pos, kv, meta)))
    return torch.cat(outs)


def save_tiny(tmp_path, cls_cfg, cls_model, **kw):
    torch.manual_seed(0)
    model = cls_model(cls_cfg(**SIZES, **kw)).eval()
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("rope", list(ROPES))
def test_llama_rope_scaling_matches_transformers(tmp_path, rope):
    hf = save_tiny(tmp_path, transformers.LlamaConfig, transformers.LlamaForCausalLM,
                   rope_parameters=ROPES[rope], tie_word_embeddings=False)
    ids = list(range(3, 43))                                   # 40 tokens, past the 16 original ctx
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(engine_logits(tmp_path, ids, split=13), want, atol=1e-4, rtol=0)


def test_qwen2_bias_and_tied_embeddings(tmp_path):
    hf = save_tiny(tmp_path, transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                   tie_word_embeddings=True)
    cfg, _ = load_model(str(tmp_path))
    assert cfg.attention_bias and cfg.tie_word_embeddings and cfg.architecture == "qwen2"
    ids = [5, 9, 1, 40, 2, 77, 3]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(engine_logits(tmp_path, ids), want, atol=1e-4, rtol=0)


def test_load_errors_name_the_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist: /no/such/model"):
        load_model("/no/such/model")
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="unsupported architectures \\['GPT2LMHeadModel'\\]"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                      **SIZES}))
    with pytest.raises(ModelLoadError, match="no \\*.safetensors weight files"):
        load_model(str(tmp_path))
    bad = tmp_path / "m.bin"
    bad.write_text("x")
    with pytest.raises(ModelLoadError, match="expected a .gguf file"):
        load_model(str(bad))
