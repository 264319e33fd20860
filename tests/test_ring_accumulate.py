"""The ring backward's accumulators (``longattn.distributed.ring._Rows``): the first block to reach a row writes it,
later ones add, rows no block reaches are zero: the same as adding every block into zeros, bit for bit."""
import random

import pytest
import torch

from longattn.distributed.ring import _Rows


@pytest.mark.parametrize("seed", range(20))
def test_rows_sum_like_zeros_plus_every_block(seed):
    rng = random.Random(seed)
    n = rng.choice([1, 7, 16, 33])
    acc = torch.full((2, n, 3), float("nan"), dtype=torch.float32)  # unwritten rows must never be read
    acc2 = torch.full((2, n, 3), float("nan"), dtype=torch.float32)
    want = torch.zeros((2, n, 3), dtype=torch.float32)
    want2 = torch.zeros((2, n, 3), dtype=torch.float32)
    full = rng.random() < 0.3
    if full:  # an accumulator received from another rank: every row holds a sum already
        start = torch.randn(2, n, 3)
        for a, w, value in ((acc, want, start), (acc2, want2, 2 * start)):
            a.copy_(value)
            w.copy_(value)
    rows = _Rows(n, full=full)
    for _ in range(rng.randint(0, 5)):
        a = rng.randint(0, n - 1)
        b = rng.randint(a + 1, n)
        x, y = torch.randn(2, b - a, 3), torch.randn(2, b - a, 3)
        rows.add(slice(a, b), (acc, x), (acc2, y))
        want[:, a:b] += x
        want2[:, a:b] += y
    rows.fill(acc, acc2)
    assert torch.equal(acc, want) and torch.equal(acc2, want2)
