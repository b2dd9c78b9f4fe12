"""On a declared signal (`on_signal`): finish the save in flight, flush the newest memory
checkpoint to storage.url within the grace period, and exit (docs/tiers.md#signals).

    signal -> delivered: the C-level handler writes its number into the wakeup pipe
              (`signal.set_wakeup_fd`), which the watching thread reads at once: the grace
              period starts now, even while the main thread waits in a collective or other
              C call (where Python runs no handler until it returns)
              inside save() (which enters `SignalGuard.saving()`)? -> act when that save
                               returns (or raises)
              otherwise      -> act now, from a thread the watcher starts (the main thread
                               may be stuck in a collective for a straggler)
           -> handler (main thread, whenever it runs): stop the DataLoader's SIGCHLD handler
              from raising into the flush (its workers die with the group); act if no one
              acts yet and no save is in flight, else wait for the exit
    act    -> the flushing rank (rank 0, or every rank without tiers): wait for the drain /
              async save in flight, copy the newest memory checkpoint to storage.url unless it
              is there, log one line, tell the other ranks, exit with status 128 + signum
    other ranks (tiers) -> a thread waits for rank 0's word (or the deadline) and exits; the
              main thread carries on meanwhile, so a save rank 0 is in still completes; a
              save that fails because rank 0 has left waits for that thread. On several
              nodes the word is read through rank 0's peer server, which serves it a moment
              longer before rank 0 exits

Nothing here runs a collective after the signal, nor touches the dataloader. The exit is
os._exit: no atexit handler, DataLoader teardown or process-group shutdown can hang it, and
a watchdog thread exits at the deadline whatever the main thread is doing.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import select
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol

from statereg.errors import SpecError
from statereg.process_state import process_wide

if TYPE_CHECKING:
    from statereg.engine.saver import Saver
    from statereg.engine.world import World
    from statereg.schemas.spec import RegistrySpec
    from statereg.tiers.engine import TierEngine

logger = logging.getLogger(__name__)

# Rank 0 writes `<prefix><token>` into the memory folder every rank shares when its flush is
# over; the token is drawn at construction, so a restarted job never reads an old one.
FLUSHED_PREFIX = "signal-flushed-"
_POLL_S = 0.02
_WORD_LINGER_S = 0.5  # rank 0 serves its word this long on several nodes (25 polls)
# The write ends of the wakeup pipes of this process's guards: a child forked from the main
# thread (a DataLoader worker) must not write its own signals into its parent's pipe.
_WAKE_FDS: set[int] = set()
process_wide(__name__, "_WAKE_FDS", "the wakeup pipes of the live signal guards; a forked child "
             "drops them itself", kept=True)


def _after_fork_in_child() -> None:
    try:
        current = signal.set_wakeup_fd(-1)
    except ValueError:  # forked from another thread than the main one: cannot be changed
        return
    if current not in _WAKE_FDS:
        signal.set_wakeup_fd(current)  # not a guard's: the child keeps it
    _WAKE_FDS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def exit_status(signum: int) -> int:
    """The status a process exits with after acting on `signum`: 128 + its number (143 for
    SIGTERM), what a shell reports for a process that signal ended."""
    return 128 + signum


def _exit(status: int) -> None:
    """Leave now: only the standard streams are flushed (their last lines are the log)."""
    for stream in (sys.stdout, sys.stderr):
        # A closed or broken stream must not keep the process alive.
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def _quiet_sigchld() -> None:
    """Stop the DataLoader's SIGCHLD handler, which raises RuntimeError in the main thread
    when a worker dies: a signal sent to the process group kills the workers too, and the
    error would otherwise abort the save in flight or the flush."""
    sigchld = getattr(signal, "SIGCHLD", None)
    if sigchld is not None:
        signal.signal(sigchld, signal.SIG_DFL)


class GuardedManager(Protocol):
    """What the guard needs of the CheckpointManager (a layer above the engine)."""

    spec: RegistrySpec
    world: World


class SignalGuard:
    """The handlers of one CheckpointManager for the signals its spec declares."""

    def __init__(self, manager: GuardedManager, saver: Saver,
                 tiers: TierEngine | None) -> None:
        declared = manager.spec.on_signal
        assert declared is not None
        self.signals = [signal.Signals[name] for name in declared.signals]
        self.grace_s = declared.grace_s
        self.rank = manager.world.rank
        self._manager = manager
        self._saver = saver
        self._tiers = tiers
        # With tiers rank 0 drains the memory folder every rank shares: it flushes for all.
        self._follower = tiers is not None and self.rank != 0
        self._flushed: str | None = None
        if tiers is not None and manager.world.size > 1:
            token = manager.world.broadcast(uuid.uuid4().hex if self.rank == 0 else None)
            self._flushed = FLUSHED_PREFIX + token
            if self.rank == 0:
                self._clear_old_words(tiers)
        self._saving = 0
        self._acting = False  # someone flushes now (the main thread or the flushing thread)
        self._received: int | None = None
        self._since = 0.0
        # Guards _saving, _acting, _received and _since between the main thread's handler
        # and save(), and the watching thread.
        self._lock = threading.Lock()
        self._previous: dict[signal.Signals, Any] = {}
        self._previous_wakeup: int | None = None  # set while this guard's pipe is the fd
        self._handled = False  # the main thread's handler ran (it acts on the first only)
        self._pid = os.getpid()
        # Signal numbers arrive here as they are delivered (set_wakeup_fd, in install());
        # a byte on the stop pipe ends the watching thread.
        self._wake_r, self._wake_w = os.pipe()
        self._stop_r, self._stop_w = os.pipe()
        for fd in (self._wake_r, self._wake_w, self._stop_w):
            os.set_blocking(fd, False)
        # Started now, not in the handler: a handler may run inside Thread.start() or a
        # lock the main thread holds, where starting a thread can fail or deadlock.
        self._watcher = threading.Thread(target=self._watch, name="statereg-signal",
                                         daemon=True)
        self._watcher.start()

    @classmethod
    def install(cls, manager: GuardedManager, saver: Saver,
                tiers: TierEngine | None) -> SignalGuard | None:
        """Handle the spec's `on_signal` for `manager` until close; None when none declared."""
        if manager.spec.on_signal is None:
            return None
        if threading.current_thread() is not threading.main_thread():
            raise SpecError(
                f"on_signal {manager.spec.on_signal.signals}: Python handles signals in the main "
                "thread only, so construct the CheckpointManager there, or remove on_signal"
            )
        guard = cls(manager, saver, tiers)
        for signum in guard.signals:
            guard._previous[signum] = signal.signal(signum, guard._handle)
        # Also wakes for signals with other Python handlers: the watcher passes those bytes
        # on to the wakeup fd that was set before (an event loop's), if any.
        guard._previous_wakeup = signal.set_wakeup_fd(guard._wake_w,
                                                      warn_on_full_buffer=False)
        _WAKE_FDS.add(guard._wake_w)
        atexit.register(guard._at_exit)
        return guard

    def uninstall(self) -> None:
        """Give the signals back to the handlers they had before (main thread only), and
        end the watching thread unless a signal is being acted on."""
        atexit.unregister(self._at_exit)
        if self._received is None:
            with contextlib.suppress(OSError):  # already stopped
                os.write(self._stop_w, b"x")
        if threading.current_thread() is not threading.main_thread():
            return  # the pipe stays the wakeup fd (its bytes are read and dropped)
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, previous)
        self._previous.clear()
        if self._previous_wakeup is None:
            return  # given back already
        current = signal.set_wakeup_fd(-1)
        signal.set_wakeup_fd(self._previous_wakeup if current == self._wake_w else current)
        self._previous_wakeup = None
        _WAKE_FDS.discard(self._wake_w)
        if self._received is None:
            self._watcher.join(5.0)
            if not self._watcher.is_alive():
                for fd in (self._wake_r, self._wake_w, self._stop_r, self._stop_w):
                    os.close(fd)

    def _clear_old_words(self, tiers: TierEngine) -> None:
        """Remove the flush notes of earlier runs of this job (one small file each)."""
        try:
            for name in tiers.memory.list_dir(""):
                if name.startswith(FLUSHED_PREFIX):
                    tiers.memory.remove_file(name)
        except Exception as exc:  # a leftover note is harmless: its token is never drawn again
            logger.debug("could not clear old signal notes in %s: %s", tiers.memory.url, exc)

    # -- the signal --------------------------------------------------------------------

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Around the manager's save(): the save counts as in flight, and a signal that came
        during it is acted on when it returns or raises (the manager enters this itself)."""
        with self._lock:
            flushing = self._acting
            if not flushing:
                self._saving += 1
        if flushing:  # a signal came and the flush runs: the process exits when it is over
            self._watcher.join()
        try:
            yield
        except BaseException as exc:
            if self._received is not None and self._follower:
                # Rank 0 left after its flush, under this rank's collective: not an error
                # of the run. The watching thread exits once it has rank 0's word.
                logger.warning("%s: a save failed after the signal (%s: %s): rank 0 has "
                               "left; waiting for its word", self._name(), type(exc).__name__,
                               exc)
                self._watcher.join()
            raise
        finally:
            with self._lock:
                self._saving -= 1
                act = self._received is not None and not self._follower and self._claim()
            if act:
                self._act()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # First of all: the signal also kills the DataLoader's workers, and their SIGCHLD
        # can run the DataLoader's handler, which raises, inside this one (seen in the drill:
        # the trainer then died with that error). Once SIG_DFL, a pending one never runs.
        if os.getpid() != self._pid:  # a forked child (a DataLoader worker): not the trainer
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        try:
            _quiet_sigchld()
        except RuntimeError:  # it ran just now, in here: the workers are gone, as expected
            _quiet_sigchld()
        if self._handled:
            return  # a repeated signal changes nothing
        self._handled = True
        self._delivered(signum)  # if its byte did not reach the watcher (another wakeup fd)
        if self._follower:
            return  # the watching thread exits once rank 0 has flushed
        with self._lock:
            saving, act = self._saving, self._claim()
        if act:
            self._act()
        elif saving:
            logger.warning("%s: finishing the save in flight first", self._name())
        else:  # the flushing thread acts: wait here for the exit (no more training steps)
            self._watcher.join()

    def _claim(self) -> bool:
        """Under the lock: whether the caller is the one to act now (a signal came, no save
        is in flight, and no one acts yet)."""
        if self._received is None or self._saving or self._acting:
            return False
        self._acting = True
        return True

    def _delivered(self, signum: int) -> None:
        """Note the first declared signal and when it came; later ones change nothing."""
        with self._lock:
            if self._received is None:
                self._received, self._since = signum, time.monotonic()
        with contextlib.suppress(OSError):  # wake the watcher (a full pipe is awake anyway)
            os.write(self._wake_w, bytes([signum]))

    def _name(self) -> str:
        assert self._received is not None
        return f"rank {self.rank}: {signal.Signals(self._received).name}"

    def _status(self) -> int:
        assert self._received is not None
        return exit_status(self._received)

    def _watch(self) -> None:
        """Wait for a declared signal's delivery; then act unless the main thread does or a
        save is in flight; on a rank other than 0 (tiers), exit once rank 0 has flushed; on
        every rank, exit when the grace period is over, whatever the main thread does."""
        declared = {int(s) for s in self.signals}
        while self._received is None:
            ready, _, _ = select.select([self._wake_r, self._stop_r], [], [])
            if self._wake_r in ready:
                data = os.read(self._wake_r, 512)
                previous = self._previous_wakeup
                if previous is not None and previous >= 0:  # set before ours (an event loop)
                    with contextlib.suppress(OSError):
                        os.write(previous, data)
                for signum in data:
                    if signum in declared:
                        self._delivered(signum)
            if self._received is None and self._stop_r in ready:
                return  # uninstalled: no signal came
        if not self._follower:
            with self._lock:
                act = self._claim()
            if act:  # from a thread of its own: this one keeps the deadline
                threading.Thread(target=self._act, name="statereg-signal-flush",
                                 daemon=True).start()
        deadline = self._since + self.grace_s
        while time.monotonic() < deadline:
            if self._follower and self._rank_zero_flushed():
                logger.warning("%s: rank 0 flushed, %.2f s after the signal; exiting with "
                               "status %d", self._name(), time.monotonic() - self._since,
                               self._status())
                _exit(self._status())
            time.sleep(min(_POLL_S, max(0.0, deadline - time.monotonic())))
        logger.error("%s: on_signal.grace_s %.1f s is over before the flush finished: "
                     "exiting with status %d; storage.url keeps its earlier checkpoints",
                     self._name(), self.grace_s, self._status())
        _exit(self._status())

    def _at_exit(self) -> None:
        """The interpreter ends after a signal (on a rank other than 0, its main thread
        returned or raised, e.g. on a dead DataLoader): stay until the watching thread exits,
        so this rank never leaves before rank 0 has flushed (rank 0 may read its files)."""
        if self._received is not None:
            self._watcher.join()

    def _rank_zero_flushed(self) -> bool:
        assert self._tiers is not None and self._flushed is not None
        try:
            return self._tiers.leader_node_has(self._flushed)
        except Exception as exc:  # the node's tmpfs: ask again until the deadline
            logger.debug("checking for rank 0's flush: %s", exc)
            return False

    def _act(self) -> None:
        """Flush, say what was flushed and how long it took, tell the other ranks, exit."""
        try:
            done, failed = self._flush(), False
        except BaseException as exc:
            done, failed = (f"the flush failed ({type(exc).__name__}: {exc}); storage.url "
                            "keeps its earlier checkpoints"), True
        (logger.error if failed else logger.warning)(
            "%s: %s, %.2f s after the signal; exiting with status %d",
            self._name(), done, time.monotonic() - self._since, self._status())
        if self._flushed is not None and self._tiers is not None:
            try:
                self._tiers.memory.write_bytes(self._flushed, b"done\n")
            except Exception as exc:  # the other ranks then exit at the deadline
                logger.error("%s: could not tell the other ranks (%s)", self._name(), exc)
            else:
                if self._tiers.nodes.count > 1:
                    # Ranks on other nodes read the word through this process's peer
                    # server: serve it a moment longer than they take to ask again.
                    time.sleep(min(_WORD_LINGER_S,
                                   max(0.0, self._since + self.grace_s - time.monotonic())))
        _exit(self._status())

    def _flush(self) -> str:
        """What this rank owes storage.url on a signal, done; a phrase saying what it was."""
        if self._tiers is None:
            self._saver.wait()
            return f"every save to {self._manager.spec.storage.url} is committed"
        name, copied = self._tiers.flush()
        if name is None:
            return f"no memory checkpoint in {self._tiers.memory.url} to flush"
        if copied:
            return (f"flushed {self._tiers.memory.display(name)} to "
                    f"{self._tiers.durable.display(name)}")
        return (f"the newest memory checkpoint is already in "
                f"{self._tiers.durable.display(name)}")
