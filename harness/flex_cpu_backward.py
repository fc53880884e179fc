"""Test scaffolding: flex attention's eager backward on the CPU, which torch 2.13 refuses up front.

Training runs flex attention on CUDA only, so without this the CPU suite could check its forward
alone (issue 67). torch has the backward everywhere: the eager flex attention is the math
formula (`sdpa_dense` forward, `sdpa_dense_backward` in torch/_higher_order_ops/flex_attention.py),
and neither depends on the device. What stops it is one check before any work,
`torch.nn.attention.flex_attention._validate_device`, which raises NotImplementedError ("FlexAttention
does not support backward on CPU") when a CPU query, key or value requires grad. (Its forward also
skips writing the log-sum-exp on the CPU, a kernel option that the eager path ignores: it always
returns the log-sum-exp the backward needs.)

`flex_backward_on_cpu()` replaces that check, for the duration of the `with` only, by the same
check on detached views of CPU tensors: every other validation (devices, shapes) still runs, and
nothing outside the block is changed. Eager only: the compiled path (inductor's CPU kernel) has no
backward at all (pytorch issue #148752), which this does not pretend to fix.

Remove this file when torch runs flex attention's backward on the CPU: the test that shows the
refusal (tests/training/test_flex_step.py) fails then, and says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch.nn.attention import flex_attention as fa

# The torch version this was written against, and that tests/training/test_flex_step.py checks
# the refusal on (2.13.0): if torch moves or renames the check, entering the block raises.
CHECK = "_validate_device"


@contextlib.contextmanager
def flex_backward_on_cpu() -> Iterator[None]:
    original = getattr(fa, CHECK)  # an AttributeError here: torch moved the check (see the module docstring)

    def validate(query, key, value):
        if query.device.type == "cpu":
            # The same checks, less the one on requires_grad: views that do not require grad.
            return original(query.detach(), key.detach(), value.detach())
        return original(query, key, value)

    setattr(fa, CHECK, validate)
    try:
        yield
    finally:
        setattr(fa, CHECK, original)
