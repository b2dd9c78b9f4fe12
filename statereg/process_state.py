"""Every piece of state statereg keeps for the whole process, listed in one registry, and
`clear_process_state()`, which clears what may be cleared.

Why a registry: a cache that lives as long as the process (a probe's answer, a kept load
plan, a warning already given) is invisible to the code that made it three calls later. A
test that wants a cold process, a worker forked from a warm one, or a job that changed its
credentials or its storage needs to drop all of them at once, and a reader needs to know
exactly which there are (docs/design.md, "Process-wide state").

Each module registers its own state right where it defines it, with one line:

    _probed_roots: dict[str, str | None] = {}
    process_wide(__name__, "_probed_roots", "one exclusivity probe per root and process")

`clear_process_state()` clears a registered container (`.clear()`), a `functools.cache`
(`.cache_clear()`), a `threading.local` (a fresh one) or a flag (its value at registration);
an entry may give its own `clear` instead. An entry registered `kept=True` is listed but never
cleared: its reason says why clearing it would break a guarantee (a live claim, a
registration the user made). Only modules already imported have registered: a module never
imported has no state to clear. tests/test_process_state.py fails when a module-level cache
appears that is not registered here.

This module imports nothing from statereg, so every layer can use it.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Values a flag may hold; a flag is reset to the value it had when it was registered.
_FLAG_TYPES = (bool, int, float, str, tuple, type(None))


@dataclass(frozen=True)
class ProcessWide:
    """One piece of process-wide state: where it lives, why it is process-wide, and how
    `clear_process_state()` clears it (never, when `kept`)."""

    module: str
    attribute: str
    reason: str
    kept: bool = False
    clear: Callable[[], object] | None = None
    initial: Any = None  # a flag's value at registration

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attribute}"

    def current(self) -> Any:
        """The object the module holds under `attribute` now."""
        return getattr(sys.modules[self.module], self.attribute)

    def reset(self) -> None:
        """Clear it (see the module docstring for what that means for each kind)."""
        if self.clear is not None:
            self.clear()
            return
        value = self.current()
        if hasattr(value, "cache_clear"):
            value.cache_clear()
        elif isinstance(value, threading.local):
            setattr(sys.modules[self.module], self.attribute, threading.local())
        elif isinstance(value, _FLAG_TYPES):
            setattr(sys.modules[self.module], self.attribute, self.initial)
        else:
            value.clear()


class BytesBounded(dict[Any, Any]):
    """A cache whose entries' stated sizes sum to at most a bound: an entry that would pass
    it first forgets all the others (layouts that come and go), and counting starts again.
    `clear()` (clear_process_state's) resets the count with the entries."""

    def __init__(self) -> None:
        super().__init__()
        self.held = 0

    def keep(self, key: Any, value: Any, size: int, bound: int) -> None:
        """Remember `value` under `key`, counting `size` bytes against `bound`."""
        if self.held + size > bound:
            self.clear()
        self[key] = value
        self.held += size

    def clear(self) -> None:
        super().clear()
        self.held = 0


_ENTRIES: dict[str, ProcessWide] = {}


def process_wide(module: str, attribute: str, reason: str, *, kept: bool = False,
                 clear: Callable[[], object] | None = None) -> None:
    """Register `module`'s `attribute` as process-wide state, with a one-line `reason`.

    `kept`: listed, never cleared (the reason says why). `clear`: how to clear it, where the
    default (by the kind of object) would be wrong. Registering a name again (a module
    reloaded) replaces its entry."""
    if not reason.strip():
        raise ValueError(f"process_wide({module}.{attribute}): give the reason it is "
                         "process-wide")
    value = getattr(sys.modules[module], attribute, None)
    initial = value if isinstance(value, _FLAG_TYPES) else None
    entry = ProcessWide(module, attribute, reason, kept, clear, initial)
    _ENTRIES[entry.name] = entry


def registered() -> list[ProcessWide]:
    """The registered process-wide state of the modules imported so far, by name."""
    return [_ENTRIES[name] for name in sorted(_ENTRIES)]


def clear_process_state() -> list[str]:
    """Clear every cache, pool and remembered answer statereg keeps for the process (entries
    registered `kept` stay), and return their names.

    Call it while no statereg save or load runs: between tests, in a worker forked from a
    process that used statereg, or after changing credentials or storage under a running
    process (fsspec's filesystem instances are among what is cleared). Everything cleared is
    rebuilt on first use: the cost is one cold save or load, never a different result."""
    cleared = []
    for entry in registered():
        if not entry.kept:
            entry.reset()
            cleared.append(entry.name)
    return cleared
