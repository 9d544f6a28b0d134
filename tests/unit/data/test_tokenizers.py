"""Tokenizers behind one interface (data/tokenizers): Hugging Face tokenizer.json files and folders, tiktoken
BPE files, the choice from ``data.tokenizer``, bits-per-byte lengths, ``data.prepare`` shards that equal the
library's own encoding, the tokenizer travelling with a run (eval and generate on a shard job after the
source file is gone), the resume-with-another-tokenizer refusal and the missing-library line."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from data_builders import TEXTS, make_hf
from trainer_utils import REPO

from torchtitan_ext.data.shards import read_shard
from torchtitan_ext.data.tokenizers import (
    META,
    HFTokenizer,
    TiktokenTokenizer,
    TokenizerError,
    load_tokenizer,
    open_tokenizer,
    run_tokenizer,
)
from torchtitan_ext.eval.bpb import token_bytes

pytest.importorskip("tokenizers")

pytest.importorskip("tiktoken")

SAMPLE = "def main(argv):\n    return 'héllo 日本' + str(len(argv))  # done\n\n"
EXTRA_LINE = "pip install -e '.[data]'"


def make_tiktoken(path: Path) -> dict[bytes, int]:
    """A tiktoken BPE file: the 256 bytes and a few merges, ranked in order."""
    ranks = {bytes([i]): i for i in range(256)}
    for merge in (b"re", b"ret", b"retu", b"return", b"  ", b"    ", b"de", b"def", b"in", b"ing", b"ma", b"main"):
        ranks[merge] = len(ranks)
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return ranks


def _cli(module: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PATH": "",
                                            **(env or {})})


def test_hf_tokenizer_folder_and_file(tmp_path):
    from tokenizers import Tokenizer

    path = make_hf(tmp_path / "hf")
    lib = Tokenizer.from_file(str(path))
    tok = open_tokenizer(str(tmp_path / "hf"))
    assert isinstance(tok, HFTokenizer) and tok.kind == "hf"
    assert (tok.eot_id, tok.bos_id, tok.pad_id) == (0, 1, 2)  # from tokenizer_config.json
    assert tok.vocab_size == lib.get_vocab_size() == 300
    assert tok.encode(SAMPLE).tolist() == lib.encode(SAMPLE, add_special_tokens=False).ids
    assert [t.tolist() for t in tok.encode_batch(TEXTS[:5])] == [lib.encode(t).ids for t in TEXTS[:5]]
    assert tok.decode(tok.encode(SAMPLE)) == SAMPLE
    assert tok.decode([*tok.encode("ab"), 400]) == "ab"  # ids past the vocabulary (padded embedding) dropped
    # bits per byte: the byte lengths of a text's tokens add up to its UTF-8 length; special tokens count 0
    lengths = tok.token_byte_lengths()
    assert lengths[tok.encode(SAMPLE)].sum() == len(SAMPLE.encode("utf-8")) and lengths[:3].tolist() == [0, 0, 0]
    table = token_bytes(tok, 320)
    assert table.shape == (320,) and table[300:].sum() == 0 and table[:300].tolist() == lengths.tolist()
    # the file itself (its tokenizer_config.json beside it) is the same tokenizer
    assert open_tokenizer(str(path)).fingerprint() == tok.fingerprint()
    # save / load: the same files, ids and fingerprint, recorded in tokenizer_meta.json
    tok.save(tmp_path / "saved")
    meta = json.loads((tmp_path / "saved" / META).read_text())
    assert meta["kind"] == "hf" and meta["vocab_size"] == 300 and (meta["eot_id"], meta["bos_id"], meta["pad_id"]) \
        == (0, 1, 2) and meta["fingerprint"] == tok.fingerprint()
    back = load_tokenizer(tmp_path / "saved")
    assert back.fingerprint() == tok.fingerprint() and back.name == tok.name
    assert back.encode(SAMPLE).tolist() == tok.encode(SAMPLE).tolist()
    assert open_tokenizer(str(tmp_path / "saved")).fingerprint() == tok.fingerprint()
    # without tokenizer_config.json: a well-known end-of-text token of the vocabulary, no bos / pad
    bare = open_tokenizer(str(make_hf(tmp_path / "bare", config=False)))
    assert (bare.eot_id, bare.bos_id, bare.pad_id) == (0, None, None) and bare.fingerprint() != tok.fingerprint()
    # a modified saved copy is refused
    (tmp_path / "saved" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<s>"}))
    with pytest.raises(TokenizerError, match="fingerprint"):
        load_tokenizer(tmp_path / "saved")


def test_tiktoken_file(tmp_path):
    import tiktoken

    from torchtitan_ext.data.tokenizers.tiktoken import ENCODINGS

    path = tmp_path / "small.tiktoken"
    ranks = make_tiktoken(path)
    tok = open_tokenizer(str(path))
    assert isinstance(tok, TiktokenTokenizer) and tok.settings()["encoding"] == "cl100k_base"  # the default
    n = len(ranks)
    assert (tok.eot_id, tok.vocab_size, tok.bos_id) == (n, n + 1, None)
    lib = tiktoken.Encoding("small", pat_str=ENCODINGS["cl100k_base"][0], mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": n})
    assert tok.encode(SAMPLE).tolist() == lib.encode_ordinary(SAMPLE)
    assert [t.tolist() for t in tok.encode_batch(TEXTS[:3])] == [lib.encode_ordinary(t) for t in TEXTS[:3]]
    assert tok.decode(tok.encode(SAMPLE)) == SAMPLE and max(tok.encode("return main")) >= 256
    lengths = tok.token_byte_lengths()
    assert lengths[tok.encode(SAMPLE)].sum() == len(SAMPLE.encode("utf-8")) and lengths[n] == 0
    # the split pattern named after the file: another tokenizer (other fingerprint)
    named = open_tokenizer(f"{path}:r50k_base")
    assert named.settings()["encoding"] == "r50k_base" and named.fingerprint() != tok.fingerprint()
    lib50 = tiktoken.Encoding("small", pat_str=ENCODINGS["r50k_base"][0], mergeable_ranks=ranks, special_tokens={})
    assert named.encode(SAMPLE).tolist() == lib50.encode_ordinary(SAMPLE)
    named.save(tmp_path / "saved")
    back = load_tokenizer(tmp_path / "saved")
    assert back.fingerprint() == named.fingerprint() and back.settings() == named.settings()
    assert back.encode(SAMPLE).tolist() == named.encode(SAMPLE).tolist()


def test_choice_from_data_tokenizer(tmp_path):
    assert open_tokenizer("byte").kind == "byte"
    (tmp_path / "vocab.txt").write_text("a\n")
    (tmp_path / "empty").mkdir()
    for spec, words in ((str(tmp_path / "vocab.txt"), "unknown tokenizer file type '.txt'"),
                        (str(tmp_path / "nothing.json"), "no such file or folder"),
                        (str(tmp_path / "empty"), "holds no tokenizer")):
        with pytest.raises(TokenizerError, match="data.tokenizer") as e:
            open_tokenizer(spec)
        assert words in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "tk").mkdir()
    make_tiktoken(tmp_path / "tk" / "enc.tiktoken")
    assert open_tokenizer(str(tmp_path / "tk")).kind == "tiktoken"
    assert open_tokenizer(f"{tmp_path / 'tk'}:o200k_base").settings()["encoding"] == "o200k_base"


def test_run_tokenizer_saves_reuses_and_refuses(tmp_path):
    src = make_hf(tmp_path / "src")
    dump = tmp_path / "dump"
    tok = run_tokenizer(str(src), 4096, None, dump, save=True)
    assert load_tokenizer(dump / "tokenizer").fingerprint() == tok.fingerprint()
    assert json.loads((dump / "tokenizer" / META).read_text())["spec"] == str(src)
    assert run_tokenizer(str(src), 4096, None, dump, save=True).fingerprint() == tok.fingerprint()
    shutil.rmtree(tmp_path / "src")  # the source is gone: the run's copy serves
    assert run_tokenizer(str(src), 4096, None, dump, save=True).fingerprint() == tok.fingerprint()
    assert run_tokenizer(str(dump / "tokenizer"), 4096, None, dump, save=True).fingerprint() == tok.fingerprint()
    make_hf(tmp_path / "src", vocab_size=280)  # another tokenizer at the same path
    with pytest.raises(TokenizerError, match="holds this run's tokenizer") as e:
        run_tokenizer(str(src), 4096, None, dump, save=True)
    assert "\n" not in str(e.value)
    with pytest.raises(TokenizerError, match="data.tokenizer = 'byte' is another"):
        run_tokenizer("byte", 4096, None, dump, save=True)
    # a start from step 0 (nothing to resume) replaces a stale copy
    assert run_tokenizer("byte", 4096, None, dump, save=True, resume=False).kind == "byte"
    assert load_tokenizer(dump / "tokenizer").kind == "byte"


def _docs(tmp_path: Path, n: int = len(TEXTS)) -> Path:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:n]))
    return path


def test_prepare_shards_equal_library_encoding(tmp_path):
    from tokenizers import Tokenizer

    path = make_hf(tmp_path / "hf")
    out = tmp_path / "shards"
    res = _cli("torchtitan_ext.data.prepare", "--input", str(_docs(tmp_path, 120)), "--output-dir", str(out),
               "--tokenizer", str(path), "--workers", "2", "--chunk-docs", "16")
    assert res.returncode == 0, res.stderr
    lib = Tokenizer.from_file(str(path))
    expected = [i for t in TEXTS[:120] for i in [*lib.encode(t).ids, 0]]  # each document, then end-of-text
    got = np.concatenate([read_shard(p) for p in sorted(out.glob("train_*.bin"))])
    assert got.tolist() == expected


@pytest.mark.parametrize("library", ["tokenizers", "tiktoken"])
def test_missing_library_names_the_extra(tmp_path, library):
    shadow = tmp_path / "shadow" / library
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(f"raise ImportError({'No module named ' + library!r})\n")
    if library == "tokenizers":
        spec = str(make_hf(tmp_path / "hf"))
    else:
        spec = str(tmp_path / "enc.tiktoken")
        make_tiktoken(Path(spec))
    res = _cli("torchtitan_ext.data.prepare", "--input", str(_docs(tmp_path, 4)), "--output-dir",
               str(tmp_path / "out"), "--tokenizer", spec, env={"PYTHONPATH": str(tmp_path / "shadow")})
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and EXTRA_LINE in lines[0] and repr(library) in lines[0], res.stderr
