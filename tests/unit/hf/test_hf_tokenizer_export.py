"""Tokenizers as Hugging Face files (``hf_files``, data/tokenizers/hf_files.py): ``AutoTokenizer`` on the
files, offline, gives our ids for hard texts and real source text (its default call and ``encode``), our
decoding, our special ids (eos = the end-of-text id that separated documents), our vocabulary size and the
chat template, for every kind: byte, SentencePiece (the builtin byte-fallback BPE, a unigram model without
byte fallback), tokenizer.json (byte-level; one whose post-processor adds a BOS) and tiktoken."""

from __future__ import annotations

import base64
import io
import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("tiktoken")

from test_tokenizers import TEXTS, make_hf  # noqa: E402

from torchtitan_ext.data.chat import ChatTemplate, conversation_tokens  # noqa: E402
from torchtitan_ext.data.corpus import read_texts, stdlib_files, training_chunks  # noqa: E402
from torchtitan_ext.data.tokenizers import (  # noqa: E402
    ByteTokenizer,
    SentencePieceTokenizer,
    TokenizerError,
    open_tokenizer,
    train_bpe,
)
from torchtitan_ext.data.tokenizers.byte_level import byte_level_alphabet  # noqa: E402

MAX_LEN = 2048
HARD = ["", " ", "a", "  two leading spaces", "trailing  ", "several     spaces", "new\nlines\n\n\ttabs\t\t x",
        "\nstarts with a newline", "12345 and 3.14159", "é café naïve 中文 日本語", "emoji 😀👍🏽 ok",
        "ＡＢＣ ﬁ ① e\u0301", "a<|endoftext|>b", "x <|endoftext|> y", "<|endoftext|> first",
        "literal <s> </s> <unk> <pad> <0x41> tokens", "def f(x):\n    return x  # é\n"]
CHAT = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}" \
       "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    """About 600 lines of the standard library's source (files from all over it), in 20-line pieces."""
    files = stdlib_files()
    return [chunk for text in read_texts(files[::len(files) // 15][:15]) for chunk in training_chunks([text], 20)[:2]]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A builtin-style BPE (train_bpe: byte fallback, <|endoftext|>, split digits) and a default SentencePiece
    unigram model (NFKC, extra whitespace removed, no byte fallback) with a pad piece."""
    import sentencepiece as spm

    folder = tmp_path_factory.mktemp("spm")
    chunks = training_chunks(read_texts(stdlib_files()[:30]))
    train_bpe(chunks, 600, folder / "bpe.model")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(chunks), model_writer=buf, vocab_size=600,
                                   model_type="unigram", pad_id=3, num_threads=1, minloglevel=2)
    (folder / "unigram.model").write_bytes(buf.getvalue())
    return {"bpe": folder / "bpe.model", "unigram": folder / "unigram.model"}


def export(tok, folder: Path):
    folder.mkdir()
    for name, data in tok.hf_files(MAX_LEN).items():
        (folder / name).write_bytes(data)
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def assert_same(tok, hf, texts: list[str]) -> None:
    assert (hf.eos_token_id, hf.bos_token_id, hf.pad_token_id) == (tok.eot_id, tok.bos_id, tok.pad_id)
    assert len(hf) == tok.vocab_size
    for text in texts:
        ids = tok.encode(text).tolist()
        assert hf(text)["input_ids"] == ids, text[:80]
        assert hf.encode(text) == ids, text[:80]
        assert hf.decode(ids) == tok.decode(ids), text[:80]


def test_byte(tmp_path, corpus):
    tok = ByteTokenizer()
    hf = export(tok, tmp_path / "hf")
    assert_same(tok, hf, HARD + corpus)
    assert hf.encode("<|endoftext|>") == list(b"<|endoftext|>")  # a literal is bytes, as ours
    assert hf.decode([104, 105, tok.eot_id]) == tok.decode([104, 105, tok.eot_id]) == "hi"


def test_sentencepiece_bpe_files(tmp_path, models, corpus):
    tok = SentencePieceTokenizer(models["bpe"])
    files = tok.hf_files(MAX_LEN)
    config = json.loads(files["tokenizer_config.json"])
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["model_max_length"] == MAX_LEN
    assert (config["eos_token"], config["bos_token"], config["pad_token"], config["unk_token"]) == \
        ("<|endoftext|>", "<s>", None, "<unk>")
    assert config["add_bos_token"] is False and config["add_eos_token"] is False
    assert config["clean_up_tokenization_spaces"] is False and "chat_template" not in config
    assert json.loads(files["special_tokens_map.json"]) == {"bos_token": "<s>", "eos_token": "<|endoftext|>",
                                                            "unk_token": "<unk>"}
    hf = export(tok, tmp_path / "hf")
    assert_same(tok, hf, HARD + corpus)
    ids = [tok.bos_id, *tok.encode(" x  y"), tok.eot_id]  # <s> vanishes, <|endoftext|> is its text
    assert hf.decode(ids) == tok.decode(ids) == " x  y<|endoftext|>"
    # the one text encoded otherwise: a special token alone is that token (SentencePiece puts the dummy ▁ first)
    assert hf.encode("<|endoftext|>") == [tok.eot_id] == tok.encode("<|endoftext|>").tolist()[1:]


def test_sentencepiece_unigram_without_byte_fallback(tmp_path, models, corpus):
    tok = SentencePieceTokenizer(models["unigram"])
    assert tok.pad_id == 3 and tok.sp.encode("中文").count(tok.sp.unk_id()) > 0  # characters it does not know
    hf = export(tok, tmp_path / "hf")
    assert_same(tok, hf, HARD + corpus)
    assert hf.decode(tok.encode("é 中文").tolist()) == tok.decode(tok.encode("é 中文"))  # " ⁇ " for unknowns


def test_hf_tokenizer_json(tmp_path, corpus):
    tok = open_tokenizer(str(make_hf(tmp_path / "src")))
    hf = export(tok, tmp_path / "hf")
    assert (tok.eot_id, tok.bos_id, tok.pad_id) == (0, 1, 2)
    assert_same(tok, hf, HARD + TEXTS[:20] + corpus)


def _llama_like(folder: Path) -> Path:
    """A byte-fallback BPE with Metaspace, a post-processor that adds <s> and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", *(f"<0x{b:02X}>" for b in range(256))]
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": CHAT}))
    return folder


def test_hf_tokenizer_json_with_bos_post_processor_and_chat_template(tmp_path, corpus):
    from tokenizers import Tokenizer

    src = _llama_like(tmp_path / "src")
    tok = open_tokenizer(str(src))
    lib = Tokenizer.from_file(str(src / "tokenizer.json"))
    assert lib.encode("hello").ids == [tok.bos_id, *tok.encode("hello").tolist()]  # ours: no BOS
    hf = export(tok, tmp_path / "hf")
    assert_same(tok, hf, HARD + corpus)
    # the exported tokenizer.json alone (the tokenizers library) gives our ids too
    assert Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json")).encode("hello").ids == \
        tok.encode("hello").tolist()
    template = ChatTemplate(tok.chat_template)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 12345"},
                {"role": "assistant", "content": "Hi, two  spaces\nand a line 42"}]
    assert hf.apply_chat_template(messages, tokenize=False) == template.render(messages)
    assert hf.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True) == \
        template.render(messages[:2], add_generation_prompt=True)
    ids = hf.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    tokens, _ = conversation_tokens(messages, tok, template, "test")
    assert ids == tokens.tolist()[:-1]  # ours closes the conversation with the end-of-text id


@pytest.fixture(scope="module")
def tiktoken_file(tmp_path_factory, corpus) -> Path:
    """A tiktoken BPE file: a byte-level BPE trained by the tokenizers library, its tokens ranked in merge order."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    lib = Tokenizer(models.BPE())
    lib.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    lib.train_from_iterator(corpus + HARD * 20, trainers.BpeTrainer(
        vocab_size=1000, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    byte_of = {c: b for b, c in enumerate(byte_level_alphabet())}
    tokens = [bytes(byte_of[c] for c in t) for t, _ in sorted(lib.get_vocab().items(), key=lambda kv: kv[1])]
    path = tmp_path_factory.mktemp("tiktoken") / "small.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    return path


@pytest.mark.parametrize("encoding", ["", ":r50k_base", ":o200k_base"])  # "": cl100k_base's pattern
def test_tiktoken(tmp_path, tiktoken_file, corpus, encoding):
    tok = open_tokenizer(f"{tiktoken_file}{encoding}")
    ranks = len(tiktoken_file.read_text().splitlines())
    assert tok.kind == "tiktoken" and tok.vocab_size == ranks + 1 and tok.eot_id == ranks > 600
    hf = export(tok, tmp_path / "hf")
    assert_same(tok, hf, HARD + corpus)
    assert max(tok.encode("12345 return self").tolist()) >= 256  # merges are used
    assert hf.encode("a<|endoftext|>") == tok.encode("a<|endoftext|>").tolist() != [97, tok.eot_id]  # text


def test_unsupported_sentencepiece_model_is_one_line(tmp_path):
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXTS), model_writer=buf, vocab_size=60, model_type="char",
                                   minloglevel=2, num_threads=1)
    (tmp_path / "char.model").write_bytes(buf.getvalue())
    with pytest.raises(TokenizerError, match="char.model: only SentencePiece unigram and BPE") as e:
        SentencePieceTokenizer(tmp_path / "char.model").hf_files()
    assert "\n" not in str(e.value)
