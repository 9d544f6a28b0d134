"""``data.dataset = "chat"``: supervised fine-tuning conversations (``data/chat.py``) from the JSONL files
``data.train_path`` / ``data.val_path`` name. Every conversation is tokenized at start-up and packed whole,
best-fit-decreasing, into windows of ``seq_len + 1`` tokens; each token sees only its own conversation
(document visibility, positions restarting at 0), and the labels of every token the loss does not count
(prompts, system turns, padding) are -100, which the cross-entropy ignores."""

from __future__ import annotations

import glob
import logging
from pathlib import Path

import numpy as np
import torch

from torchtitan_ext.data.base import Batch, EpochOrder, LoaderContext, PositionState, require_static_mixing
from torchtitan_ext.data.chat import ChatTemplate, conversation_tokens, read_conversations
from torchtitan_ext.data.documents import document_batch
from torchtitan_ext.data.packers.bfd import bfd_bins
from torchtitan_ext.errors import ConfigError

IGNORE = -100
logger = logging.getLogger(__name__)


def pack_conversations(conversations: list[tuple[np.ndarray, np.ndarray]], window: int
                       ) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, labels) of shape (windows, window): whole conversations packed best-fit-decreasing; labels
    hold each token's id where the loss counts it (as the next-token target of the position before) and
    IGNORE elsewhere, padding included (padding tokens are the end-of-text of the last conversation's id)."""
    bins = bfd_bins([len(t) for t, _ in conversations], window)
    tokens = np.zeros((len(bins), window), dtype=np.int64)
    labels = np.full((len(bins), window), IGNORE, dtype=np.int64)
    for row, members in enumerate(bins):
        t, m = (np.concatenate(parts) for parts in zip(*(conversations[i] for i in members), strict=True))
        # padding: repeats of the last end-of-text, a document of its own, never a target
        tokens[row] = np.pad(t, (0, window - len(t)), mode="edge")
        labels[row, :len(t)] = np.where(m, t, IGNORE)
    return tokens, labels


class ChatLoader(PositionState):
    """Packed conversation windows, read in a seeded order per epoch; the state is the global position."""

    sidecars = None

    def __init__(self, files: list[Path], tokenizer, template: ChatTemplate, seq_len: int, local_batch_size: int,
                 dp_rank: int, dp_world_size: int, seed: int, shuffle: bool, vocab_limit: int = 0):
        self.local_batch_size, self.dp_rank, self.dp_world_size = local_batch_size, dp_rank, dp_world_size
        self.eot_id, self.vocab_limit = tokenizer.eot_id, vocab_limit
        conversations, truncated = [], 0
        for path in files:
            for number, messages in read_conversations(path):
                tokens, mask = conversation_tokens(messages, tokenizer, template, f"{path}:{number}")
                truncated += len(tokens) > seq_len + 1
                conversations.append((tokens[:seq_len + 1], mask[:seq_len + 1]))
        if not conversations:
            raise ConfigError(f"{files[0]}: no conversations")
        self.tokens, self.labels = pack_conversations(conversations, seq_len + 1)
        if vocab_limit and int(self.tokens.max()) >= vocab_limit:
            raise ConfigError(f"{files[0].parent}: token id {int(self.tokens.max())} >= model vocabulary "
                              f"{vocab_limit}; set model.vocab_size")
        if len(self.tokens) < local_batch_size * dp_world_size:
            raise ConfigError(f"{files[0]}: {len(self.tokens)} packed windows, fewer than one global batch "
                              f"({local_batch_size * dp_world_size})")
        self._order = EpochOrder(len(self.tokens), seed, shuffle)
        counted = int((self.labels != IGNORE).sum())
        logger.info(f"chat data: {len(conversations):,} conversations in {len(self.tokens):,} windows of "
                    f"{seq_len + 1} tokens, {counted:,} tokens in the loss ({truncated} conversations truncated "
                    f"to the window)")

    def next_batch(self) -> Batch:
        rows = [self._order(g) for g in self._advance()]
        tokens, labels = torch.from_numpy(self.tokens[rows]), torch.from_numpy(self.labels[rows])
        batch = Batch(tokens[:, :-1], labels[:, 1:], torch.zeros(len(rows), dtype=torch.long))
        batch.visibility, batch.positions = document_batch(batch.inputs, self.eot_id)
        return batch


def _files(pattern: str, key: str) -> list[Path]:
    path = Path(pattern).expanduser()
    files = sorted(Path(p) for p in glob.glob(str(path / "*.jsonl" if path.is_dir() else path)))
    if not files:
        raise ConfigError(f"{key} = {pattern!r}: no chat JSONL files there")
    return files


def build(data, ctx: LoaderContext):
    require_static_mixing(data)
    if not data.train_path:
        raise ConfigError("data.train_path is empty: expected a chat JSONL file, folder or glob (data.dataset = "
                          "'chat')")
    if getattr(ctx.tokenizer, "eot_id", None) is None:
        raise ConfigError("data.dataset = 'chat' needs a tokenizer with an end-of-text token")
    template = ChatTemplate(getattr(ctx.tokenizer, "chat_template", None))
    args = dict(tokenizer=ctx.tokenizer, template=template, **ctx.window_args())
    train = ChatLoader(_files(data.train_path, "data.train_path"), shuffle=ctx.shuffle, **args)
    val = ChatLoader(_files(data.val_path, "data.val_path"), shuffle=False, **args) if data.val_path else None
    return train, val
