"""``builtin``: a SentencePiece BPE trained on the built-in corpus (``data/corpus.py``) on first use, cached."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from torchtitan_ext.data.corpus import file_lock, is_validation, read_texts, stdlib_files, training_chunks
from torchtitan_ext.data.tokenizers.sentencepiece import SentencePieceTokenizer, train_bpe

logger = logging.getLogger(__name__)


def builtin_bpe(vocab_size: int, cache_dir: Path) -> SentencePieceTokenizer:
    """``builtin``: a BPE of ``vocab_size`` pieces trained on the corpus's training files, cached."""
    model = cache_dir / f"stdlib_bpe{vocab_size}_py{sys.version_info[0]}{sys.version_info[1]}.model"
    with file_lock(cache_dir / "tokenizer.lock"):
        if not model.is_file():
            logger.info(f"training the built-in BPE tokenizer ({vocab_size} pieces) -> {model}")
            texts = read_texts([f for f in stdlib_files() if not is_validation(f)])
            train_bpe(training_chunks(texts), vocab_size, model)
    return SentencePieceTokenizer(model)
