"""Silence DCP's single-process warning during statereg's own DCP calls, and only then.

`dcp.save` and `dcp.load` warn "torch.distributed is disabled, unavailable or uninitialized"
on every call without a process group, even with `no_dist=True`; statereg makes such calls
on purpose (one process, per-rank state, shared reads), so the warning would only be noise.
A user's own DCP calls keep it: the filter is installed while at least one statereg DCP call
runs (saves run on background threads, several at once, so entries are counted under a lock
rather than nested with `warnings.catch_warnings`, which is not thread-safe) and removed when
the last one ends. A user call made while a statereg save runs is silenced too.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from statereg.process_state import process_wide

_MESSAGE = "torch.distributed is disabled, unavailable or uninitialized"
_MODULE = r"torch\.distributed\.checkpoint"
_lock = threading.Lock()
_running = 0
_entry: tuple | None = None
process_wide(__name__, "_running", "statereg DCP calls running now: the warning filter goes with "
             "the last", kept=True)
process_wide(__name__, "_entry", "the warning filter installed while they run", kept=True)


@contextmanager
def single_process_dcp() -> Iterator[None]:
    """Run the block with DCP's single-process warning ignored (see the module docstring)."""
    global _running, _entry
    with _lock:
        _running += 1
        if _running == 1:
            warnings.filterwarnings("ignore", message=_MESSAGE, module=_MODULE)
            _entry = warnings.filters[0]
    try:
        yield
    finally:
        with _lock:
            _running -= 1
            if _running == 0 and _entry is not None:
                # An "ignore" entry leaves nothing in warning registries, so removing it
                # needs no cache reset; it may already be gone (catch_warnings restored).
                if _entry in warnings.filters:
                    # a list at runtime; typeshed declares it a Sequence:
                    warnings.filters.remove(_entry)  # type: ignore[attr-defined]
                _entry = None
