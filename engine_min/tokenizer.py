"""Tokenizer and chat template from the model files (GGUF metadata or tokenizer.json).

GGUF ``tokenizer.ggml.model == "gpt2"`` vocabularies are byte-level BPE: the tokens are
already byte-level strings ("Ġthe"), merges are "a b" pairs, and token_type 3/4 marks
control / user-defined tokens (``<|im_start|>``), which are matched whole in text.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from engine_min.weights import ModelLoadError, default_model_path, gguf_field, open_gguf

_CONTROL, _USER_DEFINED = 3, 4


class Tokenizer:
    """Text <-> token ids, plus the model's chat template.

    Attributes:
        eos_token_id / bos_token_id: special ids (None when the model has none).
        chat_template: the Jinja2 template text, or None.
        vocab_size: ids are valid in ``[0, vocab_size)``.
    """

    def __init__(self, backend, eos_token_id: int | None, bos_token_id: int | None,
                 chat_template: str | None):
        self._tok = backend
        self.eos_token_id, self.bos_token_id = eos_token_id, bos_token_id
        self.chat_template = chat_template
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._template = None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special tokens written in the text are recognised; no BOS).

        Raises:
            ValueError: ``text`` is not valid Unicode (a lone surrogate, as Python makes of
                undecodable bytes in ``sys.argv``).
        """
        try:
            return self._tok.encode(text, add_special_tokens=False).ids
        except TypeError:
            if isinstance(text, str):
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise ValueError(f"text is not valid Unicode: lone surrogate "
                                     f"{text[exc.start]!r} at character {exc.start}") from None
            raise

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}]``) with the chat template.

        Raises:
            ValueError: the model has no chat template, or the template rejects the messages.
        """
        if not self.chat_template:
            raise ValueError("this model has no chat template")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(self.chat_template)
        tok = self._tok
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=tok.id_to_token(self.bos_token_id) if self.bos_token_id is not None else "",
            eos_token=tok.id_to_token(self.eos_token_id) if self.eos_token_id is not None else "")


def _raise(msg: str):
    raise ValueError(f"chat template error: {msg}")


def load_tokenizer(path: str | None, reader=None) -> Tokenizer:
    """Tokenizer of a GGUF file or a Hugging Face folder (tokenizer.json).

    ``reader``: the GGUF file's ``weights.open_gguf(path)`` if the caller already parsed it.

    Raises:
        ModelLoadError: files missing or an unsupported tokenizer model.
    """
    path = default_model_path() if path is None else str(path)
    if os.path.isdir(path):
        return _from_hf_folder(Path(path))
    return _from_gguf(path, reader)


def _from_gguf(path: str, reader=None) -> Tokenizer:
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers
    reader = reader if reader is not None else open_gguf(path)
    kind = gguf_field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(f"{path}: tokenizer model {kind!r} is not supported (only byte-level "
                             "BPE, tokenizer.ggml.model = 'gpt2')")
    tokens = gguf_field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in gguf_field(reader, "tokenizer.ggml.merges", [])]
    types = gguf_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                     fuse_unk=False, byte_fallback=False)
    tok = HFTokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if gguf_field(reader, "tokenizer.ggml.pre") in ("smollm", "starcoder", "qwen2", "llama-bpe"):
        # these vocabularies split digits apart (as their tokenizer.json does)
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty in (_CONTROL, _USER_DEFINED)])
    return Tokenizer(tok, gguf_field(reader, "tokenizer.ggml.eos_token_id"),
                     gguf_field(reader, "tokenizer.ggml.bos_token_id"),
                     gguf_field(reader, "tokenizer.chat_template"))


def _from_hf_folder(folder: Path) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer
    tj = folder / "tokenizer.json"
    if not tj.is_file():
        raise ModelLoadError(f"model folder {folder} has no tokenizer.json")
    tok = HFTokenizer.from_file(str(tj))
    tc_path = folder / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.is_file() else {}

    def special_id(name):
        t = tc.get(name)
        t = t.get("content") if isinstance(t, dict) else t
        return tok.token_to_id(t) if t else None

    template = tc.get("chat_template")
    jt = folder / "chat_template.jinja"
    if template is None and jt.is_file():
        template = jt.read_text()
    return Tokenizer(tok, special_id("eos_token"), special_id("bos_token"), template)


def export_tokenizer(tokenizer: Tokenizer, out_dir: str | os.PathLike, model_id: str,
                     model_max_length: int, model_type: str = "llama") -> list[str]:
    """Write ``tokenizer`` as a Hugging Face tokenizer folder, so clients that load one by
    path (``transformers.AutoTokenizer.from_pretrained(out_dir)``, ``vllm bench serve
    --tokenizer out_dir``) count and render tokens exactly as this engine does.

    Files (the layout ``PreTrainedTokenizerFast.save_pretrained`` writes):
    ``tokenizer.json`` (the ``tokenizers`` pipeline itself: vocabulary, merges, pre-tokenizer,
    decoder, special tokens; no post-processor, so no BOS is added, as here),
    ``tokenizer_config.json`` (class, ``chat_template``, BOS/EOS/PAD tokens,
    ``model_max_length`` in tokens, ``add_bos_token: false``), ``special_tokens_map.json``
    and a ``config.json`` holding only ``model_type``, ``vocab_size``, BOS/EOS ids and
    ``max_position_embeddings`` (vLLM reads the config next to a tokenizer to pick its mode
    and logs errors without one; there are no weights here).

    Args:
        tokenizer: the engine's tokenizer.
        out_dir: folder to write (created if missing; these three files are replaced).
        model_id: recorded as ``name_or_path``.
        model_max_length: the engine's prompt + completion limit in tokens.
        model_type: the architecture (``"llama"``, ``"mistral"``, ``"qwen2"``).

    Returns:
        the written file names.

    Raises:
        OSError: the folder cannot be written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer._tok
    try:
        tok.save(str(out / "tokenizer.json"))
    except Exception as e:  # tokenizers reports I/O errors as a plain Exception
        raise OSError(f"cannot write {out / 'tokenizer.json'}: {e}") from None
    name = (lambda i: tok.id_to_token(i) if i is not None else None)
    specials = {"bos_token": name(tokenizer.bos_token_id), "eos_token": name(tokenizer.eos_token_id),
                "pad_token": name(tokenizer.eos_token_id)}
    specials = {k: v for k, v in specials.items() if v is not None}
    extra = [t.content for t in tok.get_added_tokens_decoder().values()
             if t.special and t.content not in specials.values()]
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "name_or_path": model_id,
              "model_max_length": int(model_max_length), "add_bos_token": False,
              "add_eos_token": False, "clean_up_tokenization_spaces": False,
              "additional_special_tokens": extra, **specials}
    if tokenizer.chat_template:
        config["chat_template"] = tokenizer.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {**specials, "additional_special_tokens": extra}, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(
        {"model_type": model_type, "vocab_size": tokenizer.vocab_size,
         "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
         "max_position_embeddings": int(model_max_length)}, indent=2) + "\n")
    return ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json"]
