"""A tokenizer as Hugging Face files for an exported model: ``tokenizer.json`` (the ``tokenizers`` library's
pipeline), ``tokenizer_config.json`` and ``special_tokens_map.json``, such that ``AutoTokenizer`` on them gives
our ids for any text (no BOS / EOS added: our ``encode`` adds none), our decoding and our special ids (its eos
the end-of-text id that separated the training documents). Each kind describes itself as a :class:`Pipeline`
(its ``hf_pipeline``: ``byte_level.py``, ``sentencepiece_hf.py``, ``hf.py``)."""

from __future__ import annotations

import json
from typing import Any, NamedTuple

WHAT = "a Hugging Face tokenizer export"


class Pipeline(NamedTuple):
    """A tokenizer as a ``tokenizers.Tokenizer`` (what tokenizer.json holds) and the settings of
    tokenizer_config.json that are not in it."""

    tokenizer: Any
    unk_token: str | None = None
    # special-token literals in the text are text (our encode never reads them as the special token)
    split_special_tokens: bool = False


def _json(data: dict) -> bytes:
    return (json.dumps(data, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def tokenizer_files(tok, pipeline: Pipeline, model_max_length: int | None = None) -> dict[str, bytes]:
    """``pipeline`` (``tok``'s) as tokenizer.json, tokenizer_config.json (PreTrainedTokenizerFast, ``tok``'s special
    tokens, no BOS / EOS added, no clean-up of spaces in decoding, its chat template) and special_tokens_map.json."""
    backend = pipeline.tokenizer
    added = backend.get_added_tokens_decoder()

    def token(i: int | None) -> str | None:
        """An added token's content (``id_to_token`` gives its normalized form), another token's string."""
        return None if i is None else added[i].content if i in added else backend.id_to_token(int(i))

    special = {"bos_token": token(tok.bos_id), "eos_token": token(tok.eot_id), "pad_token": token(tok.pad_id),
               "unk_token": pipeline.unk_token}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "add_bos_token": False, "add_eos_token": False,
              "clean_up_tokenization_spaces": False, "split_special_tokens": pipeline.split_special_tokens}
    if model_max_length is not None:
        config["model_max_length"] = int(model_max_length)
    if tok.chat_template:
        config["chat_template"] = tok.chat_template
    return {"tokenizer.json": backend.to_str().encode("utf-8"), "tokenizer_config.json": _json(config),
            "special_tokens_map.json": _json({k: v for k, v in special.items() if v is not None})}
