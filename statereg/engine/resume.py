"""The resume ladder: the copies a resume may load, newest first across where they live
(memory, peers, storage.url), each loaded in turn until one loads.

`mgr.load()` without a path or a step is a resume. Its copies come from sources, nearest
first: the memory tier (this node's folder, then peers; tiers/engine.py `MemoryCopies`) and
storage.url (manager.py `DurableCopies`). `climb` walks them: it loads a copy; when the load
fails for a reason that passes over that copy (damage, a copy deleted meanwhile, a peer that
stalls), it asks the same source for the next older copy, or the next source for its newest,
logs one line naming the copy skipped, why, and the copy it resumes from instead, and loads
that. A reason that every copy would share (a wrong request) is raised at once. The next
copy loads the same components, so it overwrites whatever a failed load touched.

Every step is collective: every rank calls `climb` with the same sources, and each source
has rank 0 decide and every rank receive, so all ranks walk the same rungs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from statereg.backends.base import StorageBackend
from statereg.engine.checkpoints import Committed
from statereg.engine.load import LoadResult
from statereg.errors import StateregError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rung:
    """One copy a resume may load: a committed checkpoint on the backend that holds it."""

    backend: StorageBackend
    committed: Committed

    def display(self) -> str:
        return self.backend.display(self.committed.name)


class CopySource(Protocol):
    """Where copies of the run's checkpoints live, asked newest first (collective calls)."""

    def after(self, failed: Rung | None, error: StateregError | None) -> Rung | None:
        """The newest copy here (`failed` None), or the next one to try after `failed` failed
        with `error`; None when this source has none left."""

    def skip(self, failed: Rung, error: StateregError) -> tuple[str, str]:
        """Why `failed` is passed over and what becomes of it, for the log line ('X is
        damaged (...)', ' (the run's save of step N ... replaces it)' or ''); raises the
        error to surface instead where `error` is no reason to try another copy."""

    def exhausted(self, failed: Rung, error: StateregError) -> None:
        """`failed` was the last copy anywhere: raise the error to surface, or return to
        resume from nothing (the caller starts fresh)."""


def climb(sources: Sequence[CopySource], load: Callable[[StorageBackend, Committed], LoadResult],
          ) -> LoadResult | None:
    """Load the newest intact copy the `sources` hold, nearest source first; None when none
    holds a copy (a fresh run). One warning per copy passed over."""
    rung, at = _next(sources, 0, None, None)
    while rung is not None:
        try:
            return load(rung.backend, rung.committed)
        except StateregError as exc:
            source = sources[at]
            why, fate = source.skip(rung, exc)
            following, at = _next(sources, at, rung, exc)
            if following is None:
                source.exhausted(rung, exc)
                logger.warning("%s; no other copy to resume from%s", why, fate)
                return None
            logger.warning("%s; resuming from %s instead%s", why, following.display(), fate)
            rung = following
    return None


def _next(sources: Sequence[CopySource], at: int, failed: Rung | None,
          error: StateregError | None) -> tuple[Rung | None, int]:
    """The copy after `failed` in source `at`, else the newest of the next source that has
    one; with the index of the source it comes from."""
    for index in range(at, len(sources)):
        found = sources[index].after(failed, error)
        if found is not None:
            return found, index
        failed, error = None, None  # the sources after `at`: their newest
    return None, len(sources)
