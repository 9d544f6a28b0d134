"""The Hugging Face interchange end to end, on the folder ``python -m torchtitan_ext.export --dtype float32``
writes for a small trained run (the builtin SentencePiece tokenizer, a Llama-shaped model):

* lm-evaluation-harness's ``hf`` model, on local tasks this test writes (``loglikelihood`` and
  ``multiple_choice`` over jsonl files; nothing is downloaded), scores every request as our own model does
  with our own tokenizer: the same per-request log-likelihoods (float32, 1e-4) and greedy flags, hence the
  same aggregate metrics;
* ``transformers.pipeline("text-generation")`` greedy continues prompts with our ``generate``'s tokens and
  ``complete``'s (the generation CLI's) texts.

"Ours" reproduces the harness's request encoding (``lm_eval/api/model.py``: ``_encode_pair`` and
``loglikelihood``) with our tokenizer: a context's trailing whitespace moves to the continuation, the
continuation's tokens are those of ``encode(context + continuation)`` past ``encode(context)``'s, and an
empty context is the prefix token (BOS when the tokenizer has one, else end-of-text); the log-likelihood is
the sum over the continuation's tokens of ``log_softmax`` of our Decoder's float32 logits.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from trainer_utils import REPO, run_trainer

from torchtitan_ext.eval.load import load_trained
from torchtitan_ext.generate.decoding import complete, generate

# Nothing here may reach the Hugging Face Hub: the model, tokenizer and data sets are local folders and files.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# A Llama-shaped tiny model (exportable as LlamaForCausalLM) on the builtin 512-piece BPE, trained enough
# (200 steps, about 3 s) that greedy continuations differ from prompt to prompt.
RUN = ["--model.flavor", "1b", "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4",
       "--model.n_kv_heads", "2", "--model.ffn_hidden", "128", "--model.vocab_size", "512",
       "--data.tokenizer", "builtin", "--data.tokenizer_vocab_size", "512", "--training.seq_len", "128",
       "--training.steps", "200", "--lr_scheduler.warmup_steps", "10", "--optimizer.lr", "1e-2",
       "--metrics.log_freq", "50", "--checkpoint.enabled", "true", "--checkpoint.interval", "200"]

# (context, continuation): continuations with and without a leading space or newline, one- and many-token
# ones, a context with trailing spaces (moved to the continuation), an empty context (the prefix token),
# byte-fallback characters.
DOCS = [("def main(", "):\n    return 0"), ("import os", "\nimport sys"), ("for i in range(10): ", "print(i)"),
        ("x = ", "1"), ("", "class Foo:\n    pass"), ("if __name__ ==", " '__main__':"),
        ("The quick brown", " fox jumps over the lazy dog."), ("caf", "é € 😀")]
# (question, choices, index of the right one); the harness puts its target_delimiter " " before each choice.
CHOICES = [("def __init__(self", ["):", "]:", "})"], 0), ("import", ["os", "sys", "ZZZ"], 1),
           ("    return", ["None", "self", "\n"], 2)]
PROMPTS = ["def main(", "import os\n", "class ", "    return self."]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(dump folder, exported Hugging Face folder) of the tiny run, through the export command line."""
    root = tmp_path_factory.mktemp("hf_harness")
    run_trainer(root / "dump", 0, *RUN)
    out = subprocess.run([sys.executable, "-m", "torchtitan_ext.export", "--checkpoint", str(root / "dump"),
                          "--output", str(root / "hf"), "--dtype", "float32"], cwd=REPO, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    return root / "dump", root / "hf"


@pytest.fixture(scope="module")
def ours(exported):
    """(model, tokenizer) of the run, read from its checkpoint (not from the export)."""
    model, tok, _, _ = load_trained(exported[0])
    return model, tok


@torch.no_grad()
def our_loglikelihood(model, tok, context: str, continuation: str, prefix: int | None = None) -> tuple[float, bool]:
    """(sum of the continuation's token log-probabilities, whether each of its tokens is the argmax), for the
    tokens the harness's causal ``loglikelihood`` request encoding gives with our tokenizer; ``prefix``: the
    token an empty context stands for (the harness's ``prefix_token_id``; default BOS, else end-of-text)."""
    if context:
        n = len(context) - len(context.rstrip())
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        ctx = [int(i) for i in tok.encode(context)]
        cont = [int(i) for i in tok.encode(context + continuation)][len(ctx):]
    else:
        if prefix is None:
            prefix = tok.bos_id if tok.bos_id is not None else tok.eot_id
        cont = [int(i) for i in tok.encode(continuation)]
        ctx, cont = ([prefix], cont) if cont[0] != prefix else (cont[:1], cont[1:])
    logits = model(torch.tensor([ctx + cont[:-1]]))[0, -len(cont):].float()
    logp = F.log_softmax(logits, dim=-1)
    target = torch.tensor(cont)
    return logp.gather(-1, target[:, None]).sum().item(), bool((logp.argmax(-1) == target).all())


def _write_tasks(folder, docs, choices) -> None:
    """Two local tasks (``tt_ll``: loglikelihood, ``tt_mc``: multiple_choice) over jsonl files in ``folder``;
    the data sets' cache stays in ``folder`` too."""
    ll, mc = folder / "ll.jsonl", folder / "mc.jsonl"
    ll.write_text("".join(json.dumps({"context": c, "continuation": t}) + "\n" for c, t in docs))
    mc.write_text("".join(json.dumps({"question": q, "choices": ch, "label": y}) + "\n" for q, ch, y in choices))
    common = """dataset_path: json
test_split: test
"""
    (folder / "tt_ll.yaml").write_text(f"""task: tt_ll
{common}dataset_kwargs:
  data_files:
    test: {ll}
  cache_dir: {folder / "datasets"}
output_type: loglikelihood
doc_to_text: context
doc_to_target: continuation
metric_list:
  - metric: perplexity
  - metric: acc
""")
    (folder / "tt_mc.yaml").write_text(f"""task: tt_mc
{common}dataset_kwargs:
  data_files:
    test: {mc}
  cache_dir: {folder / "datasets"}
output_type: multiple_choice
doc_to_text: question
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
""")


def test_tokenizer_files_give_our_ids(exported, ours):
    """The export's tokenizer (as transformers loads it, with its default special-token handling: what the
    harness and the pipeline call) encodes to our ids, and names our end-of-text id as its EOS."""
    transformers = pytest.importorskip("transformers", reason="pip install -e .[dev] installs transformers")
    _, tok = ours
    hf_tok = transformers.AutoTokenizer.from_pretrained(exported[1])
    texts = [c + t for c, t in DOCS] + [t for _, t in DOCS] + [c for c, _ in DOCS if c] + PROMPTS
    for text in texts:
        assert hf_tok(text)["input_ids"] == [int(i) for i in tok.encode(text)], text
    assert hf_tok.eos_token_id == tok.eot_id
    assert hf_tok.bos_token_id == tok.bos_id, "the harness's default prefix token for an empty context"


def test_lm_eval_harness_loglikelihoods_equal_ours(exported, ours, tmp_path):
    lm_eval = pytest.importorskip("lm_eval", reason="pip install -e .[dev] installs lm-eval[hf]")
    from lm_eval.tasks import TaskManager

    model, tok = ours
    # One more document, whose continuation is our greedy one: is_greedy is True for it, False for others.
    ids = [int(i) for i in tok.encode("def main(")]
    text = tok.decode(ids + generate(model, [ids], 3)[0])
    docs = [*DOCS, ("def main(", text[len("def main("):])]
    assert our_loglikelihood(model, tok, *docs[-1])[1]
    _write_tasks(tmp_path, docs, CHOICES)
    res = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={exported[1]},dtype=float32", tasks=["tt_ll", "tt_mc"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False), log_samples=True,
        batch_size=4, device="cpu", bootstrap_iters=0)

    samples = sorted(res["samples"]["tt_ll"], key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in samples] == list(range(len(docs)))
    lls, greedy = [], []
    for s, (context, continuation) in zip(samples, docs, strict=True):
        assert [tuple(a) for a in s["arguments"]] == [(context, continuation)]
        (theirs, their_greedy), = s["filtered_resps"]
        mine, my_greedy = our_loglikelihood(model, tok, context, continuation)
        assert theirs == pytest.approx(mine, abs=1e-4), (context, continuation)
        assert their_greedy == my_greedy, (context, continuation)
        lls.append(mine)
        greedy.append(my_greedy)
    assert 0 < sum(greedy) < len(greedy)
    metrics = res["results"]["tt_ll"]
    assert metrics["acc,none"] == pytest.approx(sum(greedy) / len(greedy))
    assert metrics["perplexity,none"] == pytest.approx(math.exp(-sum(lls) / len(lls)), rel=1e-4)

    samples = sorted(res["samples"]["tt_mc"], key=lambda s: s["doc_id"])
    right = []
    for s, (question, choices, label) in zip(samples, CHOICES, strict=True):
        assert [tuple(a) for a in s["arguments"]] == [(question, " " + c) for c in choices]
        mine = [our_loglikelihood(model, tok, question, " " + c)[0] for c in choices]
        theirs = [ll for (ll, _), in s["resps"]]
        assert theirs == pytest.approx(mine, abs=1e-4), question
        right.append(max(range(len(mine)), key=mine.__getitem__) == label)
    assert res["results"]["tt_mc"]["acc,none"] == pytest.approx(sum(right) / len(right))

    # Our runs never see BOS (end-of-text separates documents): prefix_token_id=<eot> conditions an empty
    # context on it instead, as the README advises.
    res = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={exported[1]},dtype=float32,prefix_token_id={tok.eot_id}",
        tasks=["tt_ll"], task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        log_samples=True, batch_size=4, device="cpu", bootstrap_iters=0)
    for s in res["samples"]["tt_ll"]:
        context, continuation = docs[s["doc_id"]]
        (theirs, _), = s["filtered_resps"]
        mine = our_loglikelihood(model, tok, context, continuation, prefix=tok.eot_id)[0]
        assert theirs == pytest.approx(mine, abs=1e-4), (context, continuation)
        if not context:
            assert abs(mine - our_loglikelihood(model, tok, context, continuation)[0]) > 1e-2  # BOS differs


def test_pipeline_greedy_equals_generate(exported, ours):
    transformers = pytest.importorskip("transformers", reason="pip install -e .[dev] installs transformers")
    model, tok = ours
    pipe = transformers.pipeline("text-generation", model=str(exported[1]), dtype=torch.float32, device="cpu")
    assert pipe.model.generation_config.eos_token_id in (tok.eot_id, [tok.eot_id])  # it stops where we stop
    prompt_ids = [[int(i) for i in tok.encode(p)] for p in PROMPTS]  # as complete() encodes them: no BOS
    mine = [generate(model, [ids], 12, stop_id=tok.eot_id)[0] for ids in prompt_ids]
    assert len({tuple(m) for m in mine}) == len(mine)  # the prompts matter: not one repeated continuation
    texts = complete(exported[0], PROMPTS, max_new_tokens=12, device="cpu").texts
    for prompt, ids, new, text in zip(PROMPTS, prompt_ids, mine, texts, strict=True):
        out = pipe(prompt, do_sample=False, max_new_tokens=12, return_tensors=True)[0]["generated_token_ids"]
        assert [int(i) for i in out] == ids + new, prompt
        got = pipe(prompt, do_sample=False, max_new_tokens=12, return_full_text=False)[0]["generated_text"]
        assert got == text, prompt
    # A stop id met mid-way (our generate's stop_id, the pipeline's eos_token_id) ends both at the same token.
    new = mine[0]
    stop = next(t for t in new[1:] if t != new[0])
    cut = generate(model, [prompt_ids[0]], 12, stop_id=stop)[0]
    assert len(cut) < 12 and cut[-1] == stop
    out = pipe(PROMPTS[0], do_sample=False, max_new_tokens=12, eos_token_id=stop, return_tensors=True)
    assert [int(i) for i in out[0]["generated_token_ids"]] == prompt_ids[0] + cut
