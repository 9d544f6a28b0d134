"""The context parallel head-tail layout, against hand-computed chunks."""

from __future__ import annotations

import pytest
import torch

from torchtitan_ext.errors import ConfigError
from torchtitan_ext.parallel.context_parallel import causal_steps, shard_batch
from torchtitan_ext.parallel.cp_layout import check_cp_seq_len, layout_order, local_indices, shard_sequence

# seq 16: cp 2 cuts it into 4 chunks of 4, cp 4 into 8 chunks of 2; rank r holds chunks r and 2cp-1-r.
HAND = {
    (2, 0): [0, 1, 2, 3, 12, 13, 14, 15],
    (2, 1): [4, 5, 6, 7, 8, 9, 10, 11],
    (4, 0): [0, 1, 14, 15],
    (4, 1): [2, 3, 12, 13],
    (4, 2): [4, 5, 10, 11],
    (4, 3): [6, 7, 8, 9],
}


@pytest.mark.parametrize(("cp", "rank"), list(HAND))
def test_local_indices_and_shard_are_the_hand_computed_chunks(cp, rank):
    assert local_indices(16, cp, rank).tolist() == HAND[cp, rank]
    x = torch.arange(100, 132).view(2, 16)  # (batch, seq): both rows take the same columns
    assert shard_sequence(x, cp, rank).tolist() == [[100 + i for i in HAND[cp, rank]],
                                                    [116 + i for i in HAND[cp, rank]]]


@pytest.mark.parametrize("cp", [2, 4])
def test_layout_order_covers_every_token_once(cp):
    order = layout_order(16, cp)
    assert order.tolist() == sum((HAND[cp, r] for r in range(cp)), [])
    assert torch.equal(order[order.argsort()], torch.arange(16))


def test_shard_batch_gives_global_positions_and_local_keys_visibility():
    inputs = torch.arange(16)[None] + 50
    start, limit = torch.arange(16)[None], torch.full((1, 16), 16)
    limit[0, :8] = 8  # two documents of 8
    x, y, kwargs = shard_batch(inputs, inputs + 1, {"visibility": (start, limit)}, 2, 1)
    assert x.tolist() == [[50 + i for i in HAND[2, 1]]] and y.tolist() == [[51 + i for i in HAND[2, 1]]]
    assert kwargs["positions"].tolist() == [HAND[2, 1]]
    assert kwargs["visibility"][0].tolist() == [HAND[2, 1]]
    assert kwargs["visibility"][1].tolist() == [[8, 8, 8, 8, 16, 16, 16, 16]]


def test_causal_steps_balance_the_work():
    """Under causal attention every rank computes the same number of (query, key) pairs at each step."""
    cp, local = 4, 8
    for s in range(cp):
        pairs = set()
        for rank in range(cp):
            blocks = causal_steps(local, cp, rank)[s]
            pairs.add(sum((b.q_rows.stop - b.q_rows.start) * (b.k_rows.stop - b.k_rows.start) for b in blocks))
        assert len(pairs) == 1, (s, pairs)


def test_seq_len_not_divisible_by_two_cp_is_one_line():
    with pytest.raises(ConfigError, match=r"^training.seq_len = 12 must be divisible by 2 x parallelism.cp = 8 "):
        check_cp_seq_len(12, 4)
    check_cp_seq_len(16, 4)
    with pytest.raises(ConfigError, match=r"^training.seq_len = 24 must be divisible by 2 x parallelism.cp x "
                                          r"parallelism.tp = 16 \(each of the 2 x cp chunks is split over the TP"):
        check_cp_seq_len(24, 2, 4)
    check_cp_seq_len(32, 2, 4)


def test_cp_is_a_degree_of_the_world_that_reads_no_other_data():
    from torchtitan_ext.config.job_config import ParallelismSection
    from torchtitan_ext.parallel.dims import ParallelDims, ParallelDimsError

    d = ParallelDims.from_config(ParallelismSection(cp=2, tp=2), 16)
    assert (d.dp_shard, d.cp, d.tp, d.dp, d.fsdp_enabled) == (4, 2, 2, 4, True)
    assert ParallelDims.from_config(ParallelismSection(cp=2, dp_shard=1), 2).fsdp_enabled  # FSDP over cp alone
    with pytest.raises(ParallelDimsError, match=r"^parallelism: dp_replicate\(1\) x dp_shard\(2\) x cp\(2\) x tp\(1\) "
                                                r"x pp\(1\) = 4, but the world size is 8"):
        ParallelDims.from_config(ParallelismSection(cp=2, dp_shard=2), 8)

