"""Document visibility for packed windows: each token attends only within its own document.

Documents in the token stream end with the end-of-text token (``data.prepare`` appends it), so a new
document starts after every end-of-text token. A window's first document may have started in an earlier
window: it simply continues causally, and with ``position_reset`` its RoPE positions continue from where
that document began (the loader passes how many of its tokens came before the window).
"""

from __future__ import annotations

import numpy as np
import torch


def document_batch(inputs: torch.Tensor, eot_id: int, offsets: torch.Tensor | None = None
                   ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """((start, limit), positions) for input windows (batch, seq): start = the token's own index, limit =
    the end of its document in the window; positions restart at 0 after each end-of-text token, the first
    document's continuing from ``offsets`` (batch,) (0 when None)."""
    b, t = inputs.shape
    idx = torch.arange(t, device=inputs.device).expand(b, t)
    ends = inputs == eot_id
    begins = torch.zeros_like(ends)
    begins[:, 1:] = ends[:, :-1]
    first = torch.where(begins, idx, torch.zeros_like(idx)).cummax(dim=1).values  # each token's document start
    last = ends.clone()
    last[:, -1] = True
    after = torch.where(last, idx + 1, torch.full_like(idx, t))
    limit = after.flip(1).cummin(dim=1).values.flip(1)  # one past each token's document end
    positions = idx - first
    if offsets is not None:
        positions = positions + torch.where(first == 0, offsets.to(idx)[:, None], torch.zeros_like(idx))
    return (idx.contiguous(), limit), positions


class Documents:
    """``data.attention = "document"`` for a loader: visibility and (with ``position_reset``) positions of
    its windows. Finds each shard's end-of-text positions once."""

    def __init__(self, eot_id: int, position_reset: bool):
        self.eot_id, self.position_reset = eot_id, position_reset
        self._eots: dict[int, np.ndarray] = {}

    def batch(self, inputs: torch.Tensor, shards: list[np.ndarray] | None = None,
              windows: list[tuple[int, int]] | None = None):
        """(visibility, positions or None) of ``inputs`` read from (shard, first token) ``windows``; without
        them (loaders that pack whole documents) every window starts a document."""
        offsets = self.offsets(shards, windows) if self.position_reset and windows is not None else None
        visibility, positions = document_batch(inputs, self.eot_id, offsets)
        return visibility, positions if self.position_reset else None

    def offsets(self, shards: list[np.ndarray], windows: list[tuple[int, int]]) -> torch.Tensor:
        """Tokens of the document running into each window that lie before it."""
        out = []
        for shard, start in windows:
            if shard not in self._eots:
                self._eots[shard] = np.flatnonzero(np.asarray(shards[shard]) == self.eot_id)
            eots = self._eots[shard]
            j = int(np.searchsorted(eots, start, side="left")) - 1  # the last end-of-text before the window
            out.append(start - (int(eots[j]) + 1 if j >= 0 else 0))
        return torch.tensor(out, dtype=torch.long)
