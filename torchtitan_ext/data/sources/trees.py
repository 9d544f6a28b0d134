"""Conversation trees: JSONL -> token shards with a node-boundary sidecar -> windows of whole trees.

Input, one tree per JSONL line: ``{"nodes": [{"id": "a", "parent": null, "text": "..."}, ...]}`` (ids are
any JSON strings or numbers, unique within the tree; exactly the roots have no parent). Each node's text is
tokenized and followed by the end-of-text token; nodes are written in depth-first pre-order (children in
input order), so every subtree is one contiguous run of tokens. Beside each ``*.bin`` shard,
``*.trees.npz`` holds per tree its first token and its nodes' parents (tree-local, -1 for a root) and
token counts.

``TreeDataLoader`` packs whole trees into windows of ``seq_len`` tokens (trees longer than a window are
skipped and counted), and yields with every window its visibility (``ops.visibility.tree_visibility``:
a token sees its own node's earlier tokens and all of its ancestors, never a sibling's subtree), RoPE
positions along the token's root-to-node path, and labels only where the next token continues the path
(a sibling's first token is not predicted from the end of the previous sibling's subtree).

    python -m torchtitan_ext.data.prepare --trees --input 'chats/*.jsonl' --output-dir data/chats --tokenizer byte
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from torchtitan_ext.data.base import Batch, EpochOrder, LoaderContext, PositionState, require_static_mixing
from torchtitan_ext.data.shards import ShardError, read_shard, write_shard
from torchtitan_ext.data.sources.shards import shard_files
from torchtitan_ext.errors import ConfigError, UserError
from torchtitan_ext.ops.visibility import tree_visibility

TREE_SHARD_TOKENS = 1 << 26


class TreeError(UserError):
    """A bad tree record; the message names the file and line."""


def ordered_tree(record, where: str) -> tuple[list[str], list[int]]:
    """(texts, parents) of one tree record in depth-first pre-order."""
    nodes = record.get("nodes") if isinstance(record, dict) else None
    if not isinstance(nodes, list) or not nodes:
        raise TreeError(f"{where}: expected {{\"nodes\": [{{\"id\", \"parent\", \"text\"}}, ...]}}")
    ids = {}
    for i, node in enumerate(nodes):
        if not isinstance(node, dict) or not isinstance(node.get("text"), str) or "id" not in node:
            raise TreeError(f"{where}: node {i} needs an \"id\" and a \"text\" string")
        key = json.dumps(node["id"])
        if key in ids:
            raise TreeError(f"{where}: node id {key} appears twice")
        ids[key] = i
    children: dict[int, list[int]] = {i: [] for i in range(-1, len(nodes))}  # -1: the roots
    for i, node in enumerate(nodes):
        parent = node.get("parent")
        if parent is not None and json.dumps(parent) not in ids:
            raise TreeError(f"{where}: node {json.dumps(node['id'])} has unknown parent {json.dumps(parent)}")
        children[-1 if parent is None else ids[json.dumps(parent)]].append(i)
    order, parents = [], []
    stack = [(r, -1) for r in reversed(children[-1])]  # (node, its parent's index in the order)
    while stack:
        i, parent = stack.pop()
        stack.extend((c, len(order)) for c in reversed(children[i]))  # i's index: len(order) before it is added
        order.append(i)
        parents.append(parent)
    if len(order) != len(nodes):
        raise TreeError(f"{where}: the parent links form a cycle (nodes not reachable from a root)")
    return [nodes[i]["text"] for i in order], parents


def prepare_trees(files: list[Path], out: Path, tokenizer, shard_tokens: int = TREE_SHARD_TOKENS) -> dict[str, int]:
    """Write ``train_NNNNNN.bin`` shards of whole trees with their ``.trees.npz`` sidecars."""
    out.mkdir(parents=True, exist_ok=True)
    eot = tokenizer.eot_id
    counts = {"trees": 0, "nodes": 0, "tokens": 0, "shards": 0}
    buf: list[np.ndarray] = []
    firsts, parents, lengths, node_counts = [], [], [], []

    def flush() -> None:
        if not buf:
            return
        name = out / f"train_{counts['shards']:06d}"
        write_shard(name.with_suffix(".bin"), np.concatenate(buf))
        np.savez(name.with_suffix(".trees.npz"), first=np.array(firsts, dtype=np.int64),
                 nodes=np.array(node_counts, dtype=np.int64), parents=np.array(parents, dtype=np.int64),
                 lengths=np.array(lengths, dtype=np.int64))
        counts["shards"] += 1
        buf.clear(), firsts.clear(), parents.clear(), lengths.clear(), node_counts.clear()

    at = 0
    for path in files:
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise TreeError(f"{path}:{n}: not a JSON object") from None
            texts, tree_parents = ordered_tree(record, f"{path}:{n}")
            tokens = [np.asarray(list(tokenizer.encode(t)) + [eot], dtype=np.int32) for t in texts]
            if at and at + sum(map(len, tokens)) > shard_tokens:
                flush()
                at = 0
            firsts.append(at)
            node_counts.append(len(tokens))
            parents.extend(tree_parents)
            lengths.extend(len(t) for t in tokens)
            buf.extend(tokens)
            at += sum(map(len, tokens))
            counts["trees"] += 1
            counts["nodes"] += len(tokens)
            counts["tokens"] += sum(map(len, tokens))
    flush()
    return counts


class TreeDataLoader(PositionState):
    """Deterministic, stateful loader of windows packed with whole trees (state: the global position)."""

    def __init__(self, shards: list[Path], seq_len: int, local_batch_size: int, dp_rank: int,
                 dp_world_size: int, seed: int, shuffle: bool, eot_id: int = 0, position_reset: bool = True, *,
                 vocab_limit: int = 0):
        self.seq_len, self.local_batch_size, self.seed, self.shuffle = seq_len, local_batch_size, seed, shuffle
        self.dp_rank, self.dp_world_size, self.eot_id = dp_rank, dp_world_size, eot_id
        self.position_reset = position_reset
        self.trees: list[tuple[np.ndarray, list[int], list[int]]] = []  # (tokens, parents, lengths)
        self.skipped = 0
        for path in shards:
            side = path.with_suffix(".trees.npz")
            if not side.exists():
                raise ShardError(f"{path}: no tree sidecar {side.name} (prepare it with "
                                 "torchtitan_ext.data.prepare --trees)")
            tokens = read_shard(path)
            try:
                with np.load(side) as f:
                    meta = {k: f[k] for k in ("first", "nodes", "parents", "lengths")}
            except (OSError, ValueError, KeyError) as e:
                raise ShardError(f"{side}: not a tree sidecar ({type(e).__name__})") from None
            node_at = np.concatenate([[0], np.cumsum(meta["nodes"])]).astype(np.int64)
            for t, first in enumerate(meta["first"].tolist()):
                lengths = meta["lengths"][node_at[t]:node_at[t + 1]].tolist()
                parents = meta["parents"][node_at[t]:node_at[t + 1]].tolist()
                if len(parents) != len(lengths) or not lengths or first < 0 or first + sum(lengths) > len(tokens) \
                        or any(not -1 <= p < i for i, p in enumerate(parents)) or min(lengths) < 1:
                    raise ShardError(f"{side}: tree {t} does not match {path.name} (corrupted sidecar)")
                if sum(lengths) > seq_len:
                    self.skipped += 1
                    continue
                self.trees.append((tokens[first:first + sum(lengths)], parents, lengths))
        self.windows = self._pack()
        self.n_windows = len(self.windows)
        if self.n_windows < local_batch_size * dp_world_size:
            raise ShardError(f"{shards[0].parent}: {self.n_windows} windows of whole trees, fewer than one global "
                             f"batch ({local_batch_size * dp_world_size}); {self.skipped} trees exceed "
                             f"training.seq_len = {seq_len}")
        self.vocab_limit = vocab_limit
        self._order = EpochOrder(self.n_windows, seed, shuffle)

    def _pack(self) -> list[list[int]]:
        """Trees (in a seeded order) filled into windows one after another."""
        order = np.random.default_rng([self.seed, 7]).permutation(len(self.trees)) if self.shuffle \
            else np.arange(len(self.trees))
        windows, current, used = [], [], 0
        for i in order.tolist():
            n = len(self.trees[i][0])
            if used + n > self.seq_len:
                windows.append(current)
                current, used = [], 0
            current.append(i)
            used += n
        if current:
            windows.append(current)
        return windows

    def window(self, g: int) -> tuple[torch.Tensor, ...]:
        """(inputs, labels, start, limit, positions) of global window ``g``, each (seq_len,)."""
        i = self._order(g)
        t = self.seq_len
        inputs = torch.full((t,), self.eot_id, dtype=torch.long)
        start, limit = torch.arange(t), torch.arange(1, t + 1)  # padding sees only itself
        positions = torch.zeros(t, dtype=torch.long)
        labels = torch.full((t,), -100, dtype=torch.long)
        at = 0
        for tree in self.windows[i]:
            tokens, parents, lengths = self.trees[tree]
            n = len(tokens)
            inputs[at:at + n] = torch.from_numpy(tokens.astype(np.int64))
            _, lim = tree_visibility(parents, lengths)
            limit[at:at + n] = lim[0] + at
            depth = []  # tokens before each node on its root path
            for p in parents:
                depth.append(0 if p < 0 else depth[p] + lengths[p])
            positions[at:at + n] = torch.cat([torch.arange(d, d + ln) for d, ln in zip(depth, lengths, strict=True)])
            nxt = torch.arange(at + 1, at + n)
            follows = nxt < limit[at:at + n - 1]  # the next token continues this token's path
            labels[at:at + n - 1] = torch.where(follows, inputs[at + 1:at + n], -100)
            at += n
        return inputs, labels, start, limit, positions

    def next_batch(self) -> Batch:
        rows = [self.window(g) for g in self._advance()]
        inputs, labels, start, limit, positions = (torch.stack(x) for x in zip(*rows, strict=True))
        if self.vocab_limit and int(inputs.max()) >= self.vocab_limit:
            raise ShardError(f"token id {int(inputs.max())} >= model vocabulary {self.vocab_limit}; set "
                             "model.vocab_size")
        return Batch(inputs, labels, torch.zeros(len(rows), dtype=torch.long), visibility=(start, limit),
                     positions=positions if self.position_reset else None)


def build(data, ctx: LoaderContext) -> tuple[TreeDataLoader, TreeDataLoader | None]:
    """``data.dataset = "trees"`` (with ``data.attention = "tree"``): shards of whole conversation trees with
    their node sidecars."""
    if data.packing != "concat":
        raise ConfigError(f"data.dataset = 'trees' packs whole trees itself: needs data.packing = 'concat' "
                          f"(got {data.packing!r})")
    require_static_mixing(data)
    train_files, val_files = shard_files(data)
    common = dict(eot_id=ctx.eot_id, position_reset=data.position_reset, **ctx.window_args())
    loader = TreeDataLoader(train_files, shuffle=ctx.shuffle, **common)
    return loader, (TreeDataLoader(val_files, shuffle=False, **common) if val_files else None)
