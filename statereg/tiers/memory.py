"""What a node's leader keeps in its memory folder: retention (keep_last, never the checkpoint
a drain reads) on a thread, and the removal of what no one will load before a save.
"""

from __future__ import annotations

import logging
import threading

from statereg.backends.base import StorageBackend
from statereg.engine.checkpoints import step_of
from statereg.engine.retention import apply_retention
from statereg.schemas.manifest import MANIFEST_NAME
from statereg.schemas.spec import SaveSpec

logger = logging.getLogger(__name__)


class MemoryRetention:
    """Retention and clean-up of one node's memory folder (run by the node's leader)."""

    def __init__(self, memory: StorageBackend, keep_last: int) -> None:
        self.memory = memory
        self.keep_last = keep_last
        self._thread: threading.Thread | None = None

    def drop_stale(self, step: int, draining: str | None, failed: int | None) -> None:
        """Delete what no one will load from this node's memory folder:

        - checkpoints of `step` and later: the job is at `step`, so they belong to a run it
          abandoned (it resumed from an older copy, e.g. after a damaged memory file, or
          was killed in a memory save), and would refuse this save as already committed;
        - the folder of this process's previous memory save (`failed`) if that save failed
          before its commit (a full tmpfs): its files hold tmpfs pages (RAM) that retention,
          which sees committed checkpoints only, would never free. Only a save known to have
          failed: on several nodes a committed step's files may lie in a node's folder that
          did not receive the manifest, and those are still needed.

        Nothing else writes here now: the previous save, its sharing and retention are done
        (the caller waited), and the folder's lock keeps other jobs out. The durable tier is
        never touched. The save's first collective follows, so no rank of this node writes
        before this is done."""
        for entry in self.memory.list_dir(""):
            found = step_of(entry)
            if found is None or entry == draining:
                continue
            if found >= step:
                logger.warning("memory tier: removing %s, left by a run that went past step "
                               "%d before resuming from an earlier copy",
                               self.memory.display(entry), step)
            elif found == failed and not self.memory.exists(f"{entry}/{MANIFEST_NAME}"):
                logger.warning("memory tier: removing %s, left by its memory save, which "
                               "failed", self.memory.display(entry))
            else:
                continue
            self.memory.remove_tree(entry)

    def start(self, saved: str, held: str | None,
              replica: threading.Thread | None) -> None:
        """Keep the newest keep_last memory checkpoints and `held` (what a drain reads), on a
        thread: freeing tmpfs pages costs about as much as writing them (measured: unlinking
        a 0.5 GB checkpoint took longer than a third of its save), and the loop need not
        wait for it. The next save, a restore and close() wait for it. `replica` (a copy
        writing into the checkpoints retention may delete) is waited for first."""
        keep = SaveSpec(keep_last=self.keep_last)

        def retain() -> None:
            if replica is not None:
                replica.join()
            try:
                apply_retention(self.memory, keep, held or saved)
            except Exception as exc:  # the save is committed: retry at the next save
                logger.warning("memory retention in %s failed (%s); the next save retries",
                               self.memory.url, exc)

        self._thread = threading.Thread(target=retain, name="statereg-retention", daemon=True)
        self._thread.start()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
