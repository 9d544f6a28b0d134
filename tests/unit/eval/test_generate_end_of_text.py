"""Issue 44: ``generate`` stops cleanly where the model ended the text. The end-of-text token was decoded
(a literal ``<|endoftext|>`` for SentencePiece and Hugging Face tokenizers, nothing for bytes) after the
document's closing newlines, which printed as blank lines."""

from __future__ import annotations

from data_builders import make_hf

from torchtitan_ext.cli import run_tool
from torchtitan_ext.data.tokenizers import open_tokenizer
from torchtitan_ext.data.tokenizers.byte import ByteTokenizer
from torchtitan_ext.generate import decoding
from torchtitan_ext.generate.decoding import completion_text
from torchtitan_ext.tools import generate as generate_tool


def test_a_row_ended_by_the_model_drops_the_token_and_the_blank_lines(tmp_path):
    for tok in (ByteTokenizer(), open_tokenizer(str(make_hf(tmp_path / "hf")))):
        body = [int(i) for i in tok.encode("    return x\n")]
        blank = [int(i) for i in tok.encode("\n\n  \n")]
        assert completion_text(tok, body + blank + [tok.eot_id], tok.eot_id) == "    return x"
        # cut by max_new_tokens: decoded as it is, its newlines kept
        assert completion_text(tok, body + blank, tok.eot_id) == "    return x\n\n\n  \n"
        assert completion_text(tok, [tok.eot_id], tok.eot_id) == ""


def test_generate_prints_no_blank_line_at_end_of_text(monkeypatch, capsys, tmp_path):
    """The CLI on a model that ends its text after two newlines: the prompt and the text, one line each."""
    tok = ByteTokenizer()
    step = tmp_path / "checkpoint" / "step-1"  # a folder the tool's early check takes for a checkpoint
    step.mkdir(parents=True)
    (step / ".metadata").touch()

    class Loaded:
        args = None

    monkeypatch.setattr("torchtitan_ext.eval.load.load_trained", lambda checkpoint, device: (Loaded(), tok, None,
                                                                                             "ckpt"))
    monkeypatch.setattr(decoding, "generate", lambda model, ids, n, *a, **k: [
        [*tok.encode("bc\n\n").tolist(), tok.eot_id], tok.encode("de").tolist()])
    code = run_tool(generate_tool._main, ["--checkpoint", str(step), "--prompt", "a", "--prompt", "c",
                                          "--device", "cpu"])
    assert code == 0 and capsys.readouterr().out == "abc\ncde\n"
