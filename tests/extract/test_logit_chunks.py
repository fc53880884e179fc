"""The target's stored predictions do not depend on torch's thread count.

A data-parallel rank (one thread each on a shared machine) and a single process (every core)
must write the same cache, bit for bit. The CPU BLAS sums the lm_head matmul of a few row counts
(5-7 and 9-11, found by a scan) in an order that depends on the thread count, so a sample whose
last chunk of rows had such a count stored other logits in the two. The oracle: the same chunks
computed at 1 and at 2 threads, bit for bit, and the plain lm_head within float32 rounding."""

import pytest
import torch

from pipeline.target_model.capture import LogitChunks

# Lengths whose last chunk of 256 rows has each awkward count, and some that never had one.
LENGTHS = [5, 6, 7, 9, 10, 11, 261, 267, 16, 100, 256, 300]


def _chunks(lm_head, hidden: torch.Tensor, threads: int) -> torch.Tensor:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():   # as the pipeline calls it
            return torch.cat([chunk.clone() for _, chunk in LogitChunks(lm_head)(hidden)])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("length", LENGTHS)
def test_logits_are_the_same_at_any_thread_count(target, length):
    generator = torch.Generator().manual_seed(length)
    hidden = torch.randn(length, target.config.hidden_size, generator=generator)
    one, two = _chunks(target.lm_head, hidden, 1), _chunks(target.lm_head, hidden, 2)
    assert one.shape == (length, target.config.vocab_size)
    assert torch.equal(one, two), (one - two).abs().max()
    with torch.no_grad():
        torch.testing.assert_close(one, target.lm_head(hidden), rtol=1e-5, atol=1e-5)
