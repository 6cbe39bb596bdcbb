"""Batch-invariant mode: a row's output and logsumexp do not depend on the rest of the call.

Under it every forward -- flash_attn_func and the packed and varlen functions, flash_attn_with_kvcache, the paged
prefill -- runs the KV-cache kernel (kernels/decode.py) with one tile per (head dims, dtype) whatever the shapes
(ops.launch.kvcache.invariant_tiles), key blocks counted from each sequence's first key, splits of a fixed number of
keys (INVARIANT_SPLIT_KEYS) whatever the batch, and every row through the split-merging kernel in one fixed order (empty
splits add exact zeros). So a row's arithmetic is fixed by its own query, its own keys and the options: alone or in a
batch, anywhere in a varlen pack, over a contiguous or a paged cache of any page size, in a causal prefill or in a
decode step over a cache holding the same keys, it gives the same bits. The backward is the deterministic one.

State: `set_batch_invariant(on)` sets the process default (FLASHATTN2_BATCH_INVARIANT=1 at import), the context
manager `batch_invariant(on=True)` overrides it for its block in this thread or task.
"""

from __future__ import annotations

import contextlib
import contextvars

from ...errors import ArgumentTypeError
from .. import _runtime

_DEFAULT = [_runtime.env_flag("FLASHATTN2_BATCH_INVARIANT") is True]
STATE: contextvars.ContextVar[bool | None] = contextvars.ContextVar("flashattn2_batch_invariant", default=None)


def enabled() -> bool:
    """Whether calls in this thread or task run batch-invariant."""
    state = STATE.get()
    return _DEFAULT[0] if state is None else state


def set_batch_invariant(on: bool) -> bool:
    """Turn the batch-invariant mode on or off for the process (a batch_invariant() block still decides inside
    it); returns the previous setting."""
    if not isinstance(on, bool):
        raise ArgumentTypeError(f"set_batch_invariant: on must be a bool, got {type(on).__name__}")
    previous, _DEFAULT[0] = _DEFAULT[0], on
    return previous


@contextlib.contextmanager
def batch_invariant(on: bool = True):
    """Inside the block (this thread or task), calls run batch-invariant (on=False: not, whatever the default)."""
    if not isinstance(on, bool):
        raise ArgumentTypeError(f"batch_invariant: on must be a bool, got {type(on).__name__}")
    token = STATE.set(on)
    try:
        yield
    finally:
        STATE.reset(token)
