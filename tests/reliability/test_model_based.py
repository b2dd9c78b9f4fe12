"""A model-based test of the storage guarantees (issue 25, docs/reliability.md "What the model
checks"): hypothesis drives one checkpoint root with random sequences of saves (plain,
incremental, compressed, async), damage, retention, a second writer, gc, cp, loads, resumes and
kills between the steps of a save, while a reference model tracks what each committed
checkpoint must hold. After every step:

- every checkpoint `list()` names loads bit-identically to what was saved, or fails with a
  StateregError that `statereg.verify` confirms; one nothing damaged since it committed loads;
- a resume returns the newest intact checkpoint (or a damaged-but-loadable newer one), bit for
  bit, or raises a StateregError when none is intact;
- retention keeps the newest `keep_last` checkpoints that a listing can tell are loadable, every
  milestone (`keep_every`) and best (`keep_best`) one, and the one just saved;
- no operation raises anything but a StateregError; the CLI prints one line to stderr and exits
  non-zero on failure, and exits zero with nothing on stderr on success;
- liveness (issue 41): a restart (a new process, after any damage the model does, beside
  leftovers and entries another user owns, as that other user too) resumes from the newest
  intact checkpoint, and its saves of every following step commit, or raise a StateregError
  naming that step for a cause the model knows is real (another user's entry there, a
  planted claim, files another committed checkpoint references).

CI runs few sequences (≤ 60 s in all); STATEREG_MODEL_EXAMPLES=N (per store) and
STATEREG_MODEL_STEPS=N run it long, STATEREG_MODEL_SEED=N picks other sequences.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Verbosity, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from model_kit import (
    COMMITTED_POINTS,
    KILL_POINTS,
    SAVE_MODES,
    Killed,
    Live,
    Root,
    declaration,
    killed_at,
    options_args,
    paused_at_first_file,
    run_cli,
)
from other_user import OTHER, as_other_user
from reliability_kit import assert_identical
from storage_servers import new_bucket, s3_options

import statereg
from statereg.backends.registry import open_backend
from statereg.engine.checkpoints import checkpoint_name, step_of
from statereg.engine.gc import collect_garbage, find_leftovers
from statereg.engine.transfer import copy_checkpoint

STEPS = int(os.environ.get("STATEREG_MODEL_STEPS", "20"))
SEED = os.environ.get("STATEREG_MODEL_SEED")
# Sequences per store in CI; STATEREG_MODEL_EXAMPLES sets every store's count.
CI_EXAMPLES = {"local": 12, "shm": 3, "s3": 1, "no-conditional-s3": 1}


class Violation(AssertionError):
    """A guarantee the model checks does not hold. Its message ends with the sequence that
    led to it (hypothesis prints the shrunk one, unless threads made it not reproduce)."""

    def __init__(self, message: str) -> None:
        history = _RUNNING[-1].history if _RUNNING else []
        super().__init__(f"{message}\n  after: {'; '.join(history) or 'nothing'}")


_RUNNING: list[Any] = []  # the machine running now

@dataclass
class Ckpt:
    """What a committed checkpoint must hold, and what it depends on."""

    step: int
    writer: str
    state: dict[str, Any]
    metric: float
    deps: frozenset[str]  # root-relative files it reads: its own and those it references
    at: int  # the model's clock when it committed
    sums: dict[str, tuple[str, int] | None]  # deps' contents when it committed (`digest`)


@dataclass
class Env:
    """Where a sequence runs: a factory of fresh roots on one store."""

    kind: str
    make_root: Callable[[str], Root]


RETENTION = st.builds(
    lambda last, every, best: {
        "keep_last": last,
        **({"keep_every": every} if every else {}),
        **({"keep_best": {"metric": "loss", "mode": "min", "count": 1}} if best else {}),
    },
    st.integers(1, 3), st.sampled_from([None, 2, 3]), st.booleans())
OTHER_RETENTION = st.one_of(st.just({}), RETENTION)
PICK = st.integers(0, 63)
WHERE = st.sampled_from([0.0, 0.3, 0.5, 0.9])


class StorageModel(RuleBasedStateMachine):
    """One root, two trainers ("main" and "other"), and the reference model."""

    env: Env  # set by the test that runs it

    def __init__(self) -> None:
        super().__init__()
        run = uuid.uuid4().hex[:10]
        self.root = self.env.make_root(f"run-{run}")
        self.copy = self.env.make_root(f"copy-{run}")
        self.opts = self.root.options
        self.clock = 0
        self.ckpts: dict[int, Ckpt] = {}
        self.damage: dict[str, tuple[str, int]] = {}  # path -> (how, clock)
        self.revived: set[int] = set()  # readers the last save made whole again (`record`)
        self.bad_manifest: dict[int, int] = {}  # step -> clock
        self.claim_damaged: set[int] = set()
        self.foreign: dict[int, str] = {}  # step -> what another user left under its name
        self.in_flight: str | None = None  # the directory of a save running meanwhile
        self.copied: dict[int, Ckpt] = {}
        self.listed: list[int] = []
        self.next_step = 1
        self.main, self.other = Live(1), Live(2)
        self.mgrs: dict[str, statereg.CheckpointManager] = {}
        self.other_mgr: statereg.CheckpointManager | None = None
        self.rules_main: dict[str, Any] = {}
        self.rules_other: dict[str, Any] = {}
        self.other_mode = "plain"
        self.checked: tuple[Any, Any] | None = None
        self.managers: list[statereg.CheckpointManager] = []
        self.history: list[str] = []
        _RUNNING[:] = [self]

    # -- configuration -----------------------------------------------------------------

    @initialize(main=RETENTION, other=OTHER_RETENTION, other_mode=st.sampled_from(SAVE_MODES))
    def configure(self, main: dict[str, Any], other: dict[str, Any], other_mode: str) -> None:
        self.note("configure", locals())
        self.rules_main, self.rules_other, self.other_mode = main, other, other_mode

    def teardown(self) -> None:
        if os.environ.get("STATEREG_MODEL_VERBOSE"):
            print(f"sequence: {self.rules_main} other={self.rules_other} {self.other_mode}; "
                  f"steps saved {sorted(self.ckpts)}, listed {self.listed}, damage "
                  f"{len(self.damage)}, bad manifests {sorted(self.bad_manifest)}, copies "
                  f"{sorted(self.copied)}")
        for mgr in self.managers:
            with contextlib.suppress(Exception):
                mgr.close()
        self.root.destroy()
        self.copy.destroy()

    # -- plumbing ------------------------------------------------------------------------

    def manager(self, live: Live, mode: str = "plain", rules: dict[str, Any] | None = None,
                url: str | None = None, keep: bool = True) -> statereg.CheckpointManager:
        mgr = self.call("CheckpointManager(...)", lambda: statereg.CheckpointManager(
            declaration(url or self.root.url, self.opts, mode, rules), **live.objects()))
        if isinstance(mgr, statereg.StateregError):
            raise Violation(f"building a manager failed: {mgr}")
        if keep:  # closed at the end; a manager that only loads has no thread to stop
            self.managers.append(mgr)
        return mgr

    def mgr(self, mode: str) -> statereg.CheckpointManager:
        if mode not in self.mgrs:
            self.mgrs[mode] = self.manager(self.main, mode, self.rules_main)
        return self.mgrs[mode]

    def second(self) -> statereg.CheckpointManager:
        if self.other_mgr is None:
            self.other_mgr = self.manager(self.other, self.other_mode, self.rules_other)
        return self.other_mgr

    def note(self, rule: str, args: dict[str, Any]) -> None:
        """Keep the sequence so far, for a failure that does not reproduce (threads)."""
        shown = ", ".join(f"{k}={v!r}" for k, v in args.items() if k != "self")
        self.history.append(f"{rule}({shown})")

    @staticmethod
    def call(what: str, fn: Callable[[], Any]) -> Any:
        """fn()'s result, or the StateregError it raised; anything else is a violation."""
        try:
            return fn()
        except statereg.StateregError as exc:
            return exc
        except (Killed, KeyboardInterrupt, Violation):
            raise
        except BaseException as exc:
            raise Violation(f"{what} raised {type(exc).__name__}, not a StateregError: "
                            f"{exc}") from exc

    def url(self, step: int) -> str:
        return f"{self.root.url}/{checkpoint_name(step)}"

    def list_steps(self) -> list[int]:
        urls = self.call("list()", self.mgr("plain").list)
        if isinstance(urls, statereg.StateregError):
            raise Violation(f"list() failed: {urls}")
        return [step_of(u.rstrip("/").rsplit("/", 1)[-1]) for u in urls]  # type: ignore[misc]

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def intact(self, step: int) -> bool:
        """Committed, and nothing it reads was damaged since (a save that references a file
        damaged before it committed claims to have committed something that loads)."""
        ckpt = self.ckpts.get(step)
        if ckpt is None or step in self.bad_manifest:
            return False
        return not any(self.damage[p][1] > ckpt.at for p in ckpt.deps if p in self.damage)

    def looks_intact(self, step: int) -> bool:
        """Intact as far as a listing can tell: no file it reads is missing or resized (a
        flipped byte keeps the size; only reading every byte finds it)."""
        ckpt = self.ckpts.get(step)
        if ckpt is None or step in self.bad_manifest:
            return False
        return not any(self.damage[p][0] != "flip" and self.damage[p][1] > ckpt.at
                       for p in ckpt.deps if p in self.damage)

    def pristine(self, step: int) -> bool:
        """Nothing committed is damaged and `step`'s directory holds no planted claim: a
        save must then succeed."""
        return (not self.bad_manifest and step not in self.claim_damaged
                and step not in self.foreign and all(self.intact(s) for s in self.ckpts))

    def refusal(self, step: int) -> str | None:
        """Why a save of `step` by a run that resumed below it may be refused, or None (it
        must commit): the causes that stay until a person acts, each real and current."""
        name = checkpoint_name(step)
        if step in self.foreign:
            return f"another user's {self.foreign[step]} is there"
        if step in self.ckpts and self.intact(step):
            # Damaged when the run resumed below it, whole again since: an earlier save of
            # this run rewrote the file it had lost with the same bytes (seed 8103).
            return "an intact checkpoint of that step is there"
        if step in self.claim_damaged:
            return "a planted claim is there"
        readers = []
        for other, ckpt in self.ckpts.items():
            there = [p for p in ckpt.deps if p.startswith(f"{name}/")]
            # A reader whose files there are damaged since it committed, or whose manifest
            # is, loads never: it does not keep them (claims.blocking_readers).
            if other == step or not there or other in self.bad_manifest or any(
                    p in self.damage and self.damage[p][1] > ckpt.at for p in there):
                continue
            readers.append(other)
        if readers:
            return f"checkpoints {readers} reference files in it"
        return None

    def record(self, step: int, writer: str, state: dict[str, Any], metric: float) -> None:
        name = checkpoint_name(step)
        for other, ckpt in self.ckpts.items():
            # A reader whose files in this step's directory were damaged did not keep them
            # (`refusal`): the save replaced them. Each is whole again for its readers when
            # the save wrote the same bytes (a deterministic run re-saving a step, seed
            # 8103), else missing or other than recorded (seed 8009), of the same size
            # (a listing sees no damage, seed 8201) or not.
            there = [p for p in ckpt.deps if p.startswith(f"{name}/")]
            if other != step and any(
                    p in self.damage and self.damage[p][1] > ckpt.at for p in there):
                revived = True
                for p in there:
                    now, then = self.digest(p), ckpt.sums.get(p)
                    if now == then:
                        self.damage.pop(p, None)
                    else:  # other bytes of the same size: only reading them finds it
                        same_size = now is not None and then is not None and now[1] == then[1]
                        self.damage[p] = ("flip" if same_size else "delete", self.tick())
                        revived = False
                if revived:  # listed again from now on (seed 8383)
                    self.revived.add(other)
        deps: frozenset[str] = frozenset()
        manifest = self.call("read_manifest", lambda: statereg.read_manifest(
            self.url(step), self.opts))
        if isinstance(manifest, statereg.Manifest):
            deps = frozenset(f.path for f in manifest.root_files(checkpoint_name(step)))
        self.ckpts[step] = Ckpt(step, writer, state, metric, deps, self.tick(),
                                {p: self.digest(p) for p in deps})
        self.bad_manifest.pop(step, None)  # a damaged one this save retired
        self.claim_damaged.discard(step)

    def digest(self, path: str) -> tuple[str, int] | None:
        """The file's contents, hashed, and its size; None when it is missing."""
        if not self.root.exists(path):
            return None
        data = self.root.read(path)
        return hashlib.blake2b(data, digest_size=16).hexdigest(), len(data)

    def settle(self, before: list[int], retired: set[int] = frozenset()) -> list[int]:
        """List again: nothing appears that was never committed, and no intact checkpoint
        disappears but those retention may delete (`retired`)."""
        now = self.list_steps()
        strangers = [s for s in now if s not in self.ckpts]
        if strangers:
            raise Violation(f"list() names {strangers}, which no save committed")
        gone = [s for s in before if s not in now and s not in retired and self.intact(s)]
        if gone:
            raise Violation(f"intact checkpoints {gone} disappeared without retention")
        for step in retired:
            if step not in now:
                self.ckpts.pop(step, None)
        self.listed = now
        return now

    def retention(self, rules: dict[str, Any], before: list[int], saved: int,
                  now: list[int]) -> set[int]:
        """Check what a retention run (by a save of `saved` under `rules`) kept; returns the
        steps it may have deleted."""
        view = sorted({s for s in [*before, saved, *self.revived] if self.looks_intact(s)}
                      | {saved})
        self.revived.clear()
        keep_last = rules.get("keep_last")
        if keep_last is None:
            required = set(view)
        else:
            required = set(view[-keep_last:]) | {saved}
            every = rules.get("keep_every")
            if every:
                required |= {s for s in view if s % every == 0}
            if rules.get("keep_best"):
                required |= set(sorted(view, key=lambda s: self.ckpts[s].metric)[:1])
        lost = sorted(required - set(now))
        if lost:
            raise Violation(
                f"retention ({rules}) after saving step {saved} deleted {lost}; before it, "
                f"list() named {before}, of which {view} looked intact; it must keep "
                f"{sorted(required)}")
        return set(before) - set(now)

    def after_save(self, writer: str, step: int, state: dict[str, Any], metric: float,
                   error: Any, before: list[int], rules: dict[str, Any],
                   must_commit: bool) -> None:
        """A save's outcome: committed (listed, retention checked) or nothing committed."""
        if error is None:
            self.record(step, writer, state, metric)
            now = self.list_steps()
            if step not in now:
                raise Violation(f"save(step={step}) reported success, but list() names only "
                                f"{now}")
            self.settle(before, self.retention(rules, before, step, now))
            return
        if must_commit:
            raise Violation(f"save(step={step}) by {writer} failed with nothing damaged: "
                            f"{type(error).__name__}: {error}")
        now = self.settle(before)
        if step in now and step not in before:
            raise Violation(f"save(step={step}) raised {type(error).__name__} ({error}), yet "
                            "committed the checkpoint")

    def check_cli(self, run: Any) -> None:
        """Exit 0 with a quiet stderr, or non-zero with one line of error."""
        command = run.argv[0]
        if run.code == 0:
            if run.err.strip():
                raise Violation(f"statereg {' '.join(run.argv)} exited 0 but wrote to "
                                f"stderr: {run.err!r}")
            return
        lines = run.err.strip().splitlines()
        if len(lines) != 1 or not lines[0].startswith(f"statereg {command}: error: "):
            raise Violation(f"statereg {' '.join(run.argv)} exited {run.code} with stderr "
                            f"{run.err!r}: one line 'statereg {command}: error: ...' expected")

    def loads_as_saved(self, step: int, mgr_url: str | None = None,
                       expected: Ckpt | None = None) -> Any:
        """Load `step` into fresh objects; returns the error, or None when it loaded bit for
        bit as saved (a load that returns anything else is a violation)."""
        live = Live(99)
        mgr = self.manager(live, url=mgr_url, keep=False)
        got = self.call(f"load(step={step})", lambda: mgr.load(step=step))
        if isinstance(got, statereg.StateregError):
            return got
        self.same(live, expected or self.ckpts[step], f"load(step={step})")
        return None

    @staticmethod
    def same(live: Live, ckpt: Ckpt, what: str) -> None:
        try:
            assert_identical(live.snapshot(), ckpt.state, f"step {ckpt.step}")
        except AssertionError as exc:
            raise Violation(f"{what} returned other values than step {ckpt.step} saved "
                            f"({exc})") from None

    # -- invariants ---------------------------------------------------------------------

    @invariant()
    def every_listed_checkpoint_loads_or_is_reported_damaged(self) -> None:
        seen = (self.root.fingerprint(), self.copy.fingerprint() if self.copied else None)
        if seen == self.checked:
            return  # the same bytes as last time: the same outcomes
        for step in self.listed:
            error = self.loads_as_saved(step)
            if error is None:
                continue
            if self.intact(step):
                raise Violation(f"step {step}, intact since it committed, does not load: "
                                f"{type(error).__name__}: {error}")
            verified = self.call("verify", lambda s=step: statereg.verify(self.url(s),
                                                                        self.opts))
            if not isinstance(verified, statereg.StateregError):
                raise Violation(f"step {step} does not load ({error}), yet verify passes")
        self.check_resume(self.manager(fresh := Live(98), keep=False), fresh)
        for step, ckpt in self.copied.items():
            error = self.loads_as_saved(step, self.copy.url, ckpt)
            if error is not None:
                raise Violation(f"the copy of step {step} made by cp does not load: {error}")
        self.checked = seen

    def check_resume(self, mgr: statereg.CheckpointManager, live: Live) -> Any:
        """Resume into `live`; the LoadResult, None, or the StateregError (each checked)."""
        got = self.call("load()", mgr.load)
        self.check_resumed(got, lambda ckpt, what: self.same(live, ckpt, what))
        return got

    def check_resumed(self, got: Any, same: Callable[[Ckpt, str], None]) -> None:
        newest = max((s for s in self.listed if self.intact(s)), default=None)
        if isinstance(got, statereg.StateregError):
            if newest is not None:
                raise Violation(f"resume raised {type(got).__name__} ({got}) though step "
                                f"{newest} is intact")
            return
        if got is None:
            if self.ckpts:
                raise Violation(f"resume found no checkpoint, but {sorted(self.ckpts)} were "
                                "committed (a damaged root must not look empty)")
            return
        if got.step not in self.ckpts:
            raise Violation(f"resume loaded step {got.step}, which no save committed")
        same(self.ckpts[got.step], "resume")
        if newest is not None and got.step < newest:
            raise Violation(f"resume returned step {got.step}, but step {newest} is intact")

    # -- saves ---------------------------------------------------------------------------

    @rule(mode=st.sampled_from(SAVE_MODES), train=st.booleans(), level=st.integers(0, 3))
    def save(self, mode: str, train: bool, level: int) -> None:
        self.note("save", locals())
        if train:
            self.main.train()
        step, self.next_step = self.next_step, self.next_step + 1
        metric = level + step / 1000
        mgr = self.mgr(mode)
        must = self.pristine(step) and not mgr._damaged
        before, state = self.listed, self.main.snapshot()

        def save() -> None:
            mgr.save(step=step, extra={"loss": metric, "writer": "main"})
            if mode == "async":
                self.main.train()  # the loop goes on while the background thread writes
                mgr.wait()

        error = self.call(f"save(step={step}, {mode})", save)
        self.after_save("main", step, state, metric, error, before, self.rules_main, must)

    @rule(mode=st.sampled_from(SAVE_MODES), level=st.integers(0, 3))
    def train_and_save(self, mode: str, level: int) -> None:
        """The common case, drawn as often again as every other save: saves outnumber the
        rest, so damage meets retention and incremental reuse within a few steps."""
        self.save(mode, True, level)

    @rule(train=st.booleans(), level=st.integers(0, 3))
    def second_writer_saves(self, train: bool, level: int) -> None:
        self.note("second_writer_saves", locals())
        if train:
            self.other.train()
        step, self.next_step = self.next_step, self.next_step + 1
        self.other_save(step, level)

    def other_save(self, step: int, level: int) -> None:
        metric = level + step / 1000
        mgr = self.second()
        must = self.pristine(step) and not mgr._damaged
        before, state = self.listed, self.other.snapshot()

        def save() -> None:
            mgr.save(step=step, extra={"loss": metric, "writer": "other"})
            mgr.wait()

        error = self.call(f"second writer's save(step={step})", save)
        self.after_save("other", step, state, metric, error, before, self.rules_other, must)

    @rule(which=st.sampled_from(["huge step", "huge tokens_seen", "huge int in extra",
                                 "nan in extra", "negative step"]))
    def save_with_bad_arguments(self, which: str) -> None:
        self.note("save_with_bad_arguments", locals())
        step = {"huge step": 2**64, "negative step": -1}.get(which, self.next_step)
        kwargs: dict[str, Any] = {"step": step, "extra": {"loss": 9.0, "writer": "main"}}
        if which == "huge tokens_seen":
            kwargs["tokens_seen"] = 2**64 + 1
        if which == "huge int in extra":
            kwargs["extra"] = {"n": 10**5000}
        if which == "nan in extra":
            kwargs["extra"] = {"loss": float("nan")}
        mgr = self.mgr("plain")
        before, state = self.listed, self.main.snapshot()
        error = self.call(f"save({which})", lambda: mgr.save(**kwargs))
        if error is None and step == self.next_step:
            self.next_step += 1
        self.after_save("main", step, state, 9.0, error, before, self.rules_main, False)

    @rule(mode=st.sampled_from(SAVE_MODES), point=st.sampled_from(KILL_POINTS),
          train=st.booleans())
    def save_killed(self, mode: str, point: str, train: bool) -> None:
        """The process dies at `point` of a save; a new process (a new manager) goes on."""
        self.note("save_killed", locals())
        if train:
            self.main.train()
        step = self.next_step
        metric = 5 + step / 1000
        mgr = self.manager(self.main, mode, self.rules_main)
        must = self.pristine(step)
        before, state = self.listed, self.main.snapshot()

        def save() -> None:
            mgr.save(step=step, extra={"loss": metric, "writer": "main"})
            mgr.wait()

        with killed_at(point, mgr._backend, checkpoint_name(step)) as fired:
            try:
                error = self.call(f"save(step={step}, {mode}) killed at {point}", save)
            except BaseException:
                if not fired.is_set():
                    raise
                error = Killed(point)  # raised at the point, or wrapped by DCP's threads
        with contextlib.suppress(BaseException):
            mgr._saver.close()  # the dead process's threads
        self.managers.remove(mgr)
        self.mgrs.clear()  # every manager of the main trainer died with the process
        if not fired.is_set():
            self.next_step += 1
            self.after_save("main", step, state, metric, error, before, self.rules_main, must)
            return
        if point in COMMITTED_POINTS:
            self.next_step += 1
            self.record(step, "main", state, metric)
            now = self.list_steps()
            if step not in now:
                raise Violation(f"killed at {point}, step {step} had committed, but list() "
                                f"names only {now}")
            retired = (self.retention(self.rules_main, before, step, now)
                       if point == "mid_retention" else set())
            self.settle(before, retired)
            return
        # Killed before the commit: nothing committed; the restarted job saves this step again.
        now = self.settle(before)
        if step in now:
            raise Violation(f"a save killed at {point} left step {step} committed")

    @rule(during=st.lists(st.sampled_from(["second writer saves", "gc --delete", "gc"]),
                          min_size=1, max_size=3), train=st.booleans())
    def save_while_others_work(self, during: list[str], train: bool) -> None:
        """An incremental save, stopped after it named its base in its claim, while the
        other job saves (its retention may uncommit that base) and gc runs."""
        self.note("save_while_others_work", locals())
        if train:
            self.main.train()
        step, self.next_step = self.next_step, self.next_step + 1
        metric = 6 + step / 1000
        mgr = self.manager(self.main, "incremental", self.rules_main)
        must = self.pristine(step)
        state = self.main.snapshot()
        outcome: dict[str, Any] = {}

        def save() -> None:
            try:
                got = self.call(f"save(step={step}, incremental)", lambda: mgr.save(
                    step=step, extra={"loss": metric, "writer": "main"}))
                outcome["error"] = got if isinstance(got, statereg.StateregError) else None
            except BaseException as exc:  # reported by the main thread
                outcome["error"] = exc

        self.in_flight = checkpoint_name(step)
        with paused_at_first_file(mgr._backend, checkpoint_name(step)) as (there, go):
            thread = threading.Thread(target=save, name=f"model-save-{step}")
            thread.start()
            try:
                while not there.wait(0.01) and thread.is_alive():
                    pass
                for what in during:
                    if not there.is_set():
                        break  # the save ended before its first file
                    if what == "second writer saves":
                        other, self.next_step = self.next_step, self.next_step + 1
                        self.other_save(other, 1)
                    else:
                        self.collect(delete=what == "gc --delete", via_cli=False)
            finally:
                go.set()
                thread.join(60)
                self.in_flight = None
        error = outcome.get("error")
        if isinstance(error, BaseException) and not isinstance(error, statereg.StateregError):
            raise error
        self.after_save("main", step, state, metric, error, self.listed, self.rules_main, must)

    @rule(train=st.booleans())
    def two_writers_race_for_one_step(self, train: bool) -> None:
        self.note("two_writers_race_for_one_step", locals())
        if train:
            self.main.train()
            self.other.train()
        step, self.next_step = self.next_step, self.next_step + 1
        metric = 7 + step / 1000
        lives = {"main": self.main, "other": self.other}
        rules = {"main": self.rules_main, "other": self.rules_other}
        mgrs = {w: self.manager(lives[w], "plain", rules[w]) for w in lives}
        states = {w: lives[w].snapshot() for w in lives}
        must = self.pristine(step)
        before = self.listed
        barrier = threading.Barrier(2)
        results: dict[str, Any] = {}

        def save(writer: str) -> None:
            try:
                barrier.wait(30)
                results[writer] = self.call(f"{writer}'s racing save(step={step})", lambda: (
                    mgrs[writer].save(step=step, extra={"loss": metric, "writer": writer})))
            except BaseException as exc:  # reported below
                results[writer] = exc

        threads = [threading.Thread(target=save, args=(w,)) for w in lives]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for writer, got in results.items():
            if isinstance(got, BaseException) and not isinstance(got, statereg.StateregError):
                raise Violation(f"{writer}'s racing save raised {got!r}") from got
        told = sorted(w for w, got in results.items() if not isinstance(got, BaseException))
        now = self.list_steps()
        if step not in now:
            if told:
                raise Violation(f"{told} told 'committed' for step {step}, which list() does "
                                "not name")
            if must:
                raise Violation(f"neither racing save of step {step} committed: {results}")
            self.settle(before)
            return
        manifest = self.call("read_manifest", lambda: statereg.read_manifest(self.url(step),
                                                                            self.opts))
        if isinstance(manifest, statereg.StateregError):
            raise Violation(f"list() names step {step}, whose manifest does not read: "
                            f"{manifest}")
        winner = manifest.extra.get("writer")
        if told != [winner]:
            raise Violation(f"step {step} holds {winner}'s manifest, but {told or 'nobody'} "
                            f"was told 'committed' ({results})")
        self.record(step, winner, states[winner], metric)
        self.settle(before, self.retention(rules[winner], before, step, now))

    # -- damage --------------------------------------------------------------------------

    def pick_listed(self, pick: int) -> int | None:
        listed = [s for s in self.listed if s in self.ckpts]
        return listed[pick % len(listed)] if listed else None

    @rule(pick=PICK, file=PICK, how=st.sampled_from(["flip", "truncate", "delete"]),
          where=WHERE)
    def damage_a_file(self, pick: int, file: int, how: str, where: float) -> None:
        self.note("damage_a_file", locals())
        step = self.pick_listed(pick)
        if step is None:
            return
        deps = sorted(self.ckpts[step].deps)
        path = deps[file % len(deps)]
        if not self.root.exists(path):
            return
        if how == "flip":
            self.root.flip(path, where)
        elif how == "truncate":
            self.root.truncate(path, where)
        else:
            self.root.remove(path)
        self.damage[path] = (how, self.tick())
        self.settle(self.listed)

    @rule(file=PICK, how=st.sampled_from(["flip", "truncate", "delete"]), where=WHERE,
          mode=st.sampled_from(SAVE_MODES), saves=st.integers(1, 2))
    def damage_the_newest_then_save(self, file: int, how: str, where: float, mode: str,
                                    saves: int) -> None:
        """Damage in the newest checkpoint (bit rot, a truncated copy) while training goes
        on: the next saves' retention and incremental reuse meet it at once, which random
        interleavings reach only rarely within CI's few sequences."""
        self.damage_a_file(-1, file, how, where)
        for _ in range(saves):
            self.save(mode, True, 0)

    @rule(where=WHERE, saves=st.integers(1, 2))
    def rot_a_reused_file_then_save_incremental(self, where: float, saves: int) -> None:
        """Bit rot in a file the newest checkpoint references rather than wrote (a frozen
        base, written once): the incremental saves that follow reuse that file's tensors
        by their recorded digests, and must not build on the rotten copy."""
        self.note("rot_a_reused_file_then_save_incremental", locals())
        step = self.pick_listed(-1)
        if step is not None:
            own = f"{checkpoint_name(step)}/"
            deps = sorted(self.ckpts[step].deps)
            reused = [p for p in deps if not p.startswith(own) and p.endswith(".distcp")]
            path = (reused or [p for p in deps if p.endswith(".distcp")] or deps)[0]
            if self.root.exists(path):
                self.root.flip(path, where)
                self.damage[path] = ("flip", self.tick())
                self.settle(self.listed)
        for _ in range(saves):
            self.save("incremental", True, 0)

    @rule(pick=PICK, which=st.sampled_from(["manifest.json", "manifest.sum"]),
          how=st.sampled_from(["link", "fifo", "garbage"]), to=PICK)
    def damage_a_manifest(self, pick: int, which: str, how: str, to: int) -> None:
        self.note("damage_a_manifest", locals())
        step = self.pick_listed(pick)
        if step is None:
            return
        target = self.pick_listed(to)
        self.root.replace(f"{checkpoint_name(step)}/{which}", how,
                          f"{checkpoint_name(target)}/{which}" if target != step else None)
        self.bad_manifest[step] = self.tick()
        self.settle(self.listed)

    @rule(how=st.sampled_from(["link", "fifo", "garbage"]), ahead=st.integers(0, 2))
    def plant_a_claim(self, how: str, ahead: int) -> None:
        """A `.claim-00000` that is no claim, in the directory of a step about to be saved."""
        self.note("plant_a_claim", locals())
        step = self.next_step + ahead
        self.root.replace(f"{checkpoint_name(step)}/.claim-00000", how)
        self.claim_damaged.add(step)
        self.settle(self.listed)

    # -- restarts: the run comes back and goes on (liveness, issue 41) --------------------

    def die(self) -> None:
        """The job's processes end: every manager of either trainer stops."""
        for mgr in [*self.mgrs.values(), *([self.other_mgr] if self.other_mgr else [])]:
            with contextlib.suppress(BaseException):
                mgr.close()
        self.mgrs.clear()
        self.other_mgr = None

    def go_on_saving(self, resumed: int, step: int, error: Any, state: dict[str, Any],
                     before: list[int]) -> None:
        """The outcome of a restarted run's save of `step` (it resumed from `resumed`):
        committed, or refused for a real, current cause the model knows, naming the step."""
        self.check_refused(resumed, step, error)
        self.after_save("main", step, state, step / 1000, error, before, self.rules_main,
                        False)

    def check_refused(self, resumed: int, step: int, error: Any) -> None:
        why = self.refusal(step)
        if error is not None:
            if why is None:
                raise Violation(f"a run resumed from step {resumed} cannot go on: its "
                                f"save(step={step}) failed ({type(error).__name__}: {error}); "
                                "nothing the user must act on is in its way")
            if checkpoint_name(step) not in str(error):
                raise Violation(f"save(step={step}) was refused ({why}) with an error that "
                                f"does not name its directory: {error}")

    def restart(self, mode: str, saves: int) -> None:
        """A new process resumes (the newest intact checkpoint, checked) and saves the next
        `saves` steps after the one it resumed from, training between them."""
        self.die()
        fresh = Live(97)
        mgr = self.manager(fresh, mode, self.rules_main)
        got = self.check_resume(mgr, fresh)
        if isinstance(got, statereg.StateregError):
            return  # nothing intact: nothing to go on from (check_resume checked that)
        resumed = got.step if got is not None else 0
        self.main, self.mgrs = fresh, {mode: mgr}
        for step in range(resumed + 1, resumed + 1 + saves):
            fresh.train()
            before, state = self.listed, fresh.snapshot()

            def save(step: int = step) -> None:
                mgr.save(step=step, extra={"loss": step / 1000, "writer": "main"})
                mgr.wait()

            error = self.call(f"save(step={step}, {mode}) after a restart", save)
            self.go_on_saving(resumed, step, error, state, before)
        self.next_step = max(self.next_step, resumed + 1 + saves)

    @rule(mode=st.sampled_from(SAVE_MODES), saves=st.integers(1, 3))
    def restart_and_go_on(self, mode: str, saves: int) -> None:
        self.note("restart_and_go_on", locals())
        self.restart(mode, saves)

    @rule(file=PICK, how=st.sampled_from(["flip", "truncate", "delete", "manifest.json",
                                          "manifest.sum"]),
          where=WHERE, mode=st.sampled_from(SAVE_MODES), saves=st.integers(1, 2))
    def damage_the_newest_then_restart(self, file: int, how: str, where: float, mode: str,
                                       saves: int) -> None:
        """Issue 41's sequence: the newest checkpoint is damaged, the job restarts, resumes
        from an older one, and saves the damaged one's step again (every restart)."""
        self.note("damage_the_newest_then_restart", locals())
        if how.startswith("manifest"):
            self.damage_a_manifest(-1, how, ("garbage", "link", "fifo")[file % 3], file)
        else:
            self.damage_a_file(-1, file, how, where)
        self.restart(mode, saves)

    @rule(what=st.sampled_from(["leftover", "retired leftover", "file"]),
          saves=st.integers(1, 3))
    def restart_as_another_user(self, what: str, saves: int) -> None:
        """On a shared root: another user (root here) leaves `what` under the next step's
        name, mode 0700; the run, now a process of a second real user (uid 65534) that owns
        the run's files, restarts, resumes and saves on. Local disk only, as root only."""
        self.note("restart_as_another_user", locals())
        if self.env.kind != "local" or os.geteuid() != 0:
            return
        self.die()
        step = self.next_step
        while self.root.exists(checkpoint_name(step)):  # e.g. a planted claim's directory
            step += 1
        self.next_step = step + 1
        name = checkpoint_name(step)
        os.makedirs(self.root.path, exist_ok=True)
        for top, dirs, files in os.walk(self.root.path):  # the run's files are its user's
            for entry in [top, *(os.path.join(top, e) for e in dirs + files)]:
                os.lchown(entry, OTHER, OTHER)
        full = self.root.full(name)
        if what == "file":
            with open(full, "wb") as f:
                f.write(b"not a checkpoint")
        else:
            marker = ".retired" if what == "retired leftover" else "model/__0_0.distcp"
            os.makedirs(os.path.dirname(f"{full}/{marker}"), exist_ok=True)
            with open(f"{full}/{marker}", "wb") as f:
                f.write(b"x" * 64)
        os.chmod(full, 0o700)
        self.foreign[step] = what
        url, opts, rules = self.root.url, self.opts, self.rules_main

        def run() -> dict[str, Any]:
            # The model's killed saves stand for processes that died, but this test's own
            # process lives on: seen from the restart, that process is gone (seed 4404).
            killed, alive = os.getppid(), statereg.engine.claims._pid_alive
            statereg.engine.claims._pid_alive = lambda pid: pid != killed and alive(pid)
            live = Live(96)
            mgr = statereg.CheckpointManager(declaration(url, opts, "plain", rules),
                                             **live.objects())
            out: dict[str, Any] = {"saves": []}
            try:
                got = mgr.load()
            except statereg.StateregError as exc:
                out["resumed"] = exc
                return out
            out["resumed"] = None if got is None else SimpleNamespace(step=got.step)
            out["state"] = live.snapshot()
            start = got.step + 1 if got is not None else 1
            for n in range(start, start + saves):
                live.train()
                state = live.snapshot()
                try:
                    mgr.save(step=n, extra={"loss": n / 1000, "writer": "main"})
                    error = None
                except statereg.StateregError as exc:
                    error = exc
                out["saves"].append((n, error, state))
            mgr.close()
            return out

        outcome = as_other_user(run)
        resumed = outcome["resumed"]
        self.check_resumed(resumed, lambda ckpt, what: self.same_state(
            outcome["state"], ckpt, f"{what} as a second user"))
        if isinstance(resumed, statereg.StateregError):
            return
        # Its saves ran in another process: record what each committed, then check the
        # listing and the last save's retention at once.
        before, committed = self.listed, []
        for n, error, state in outcome["saves"]:
            self.check_refused(resumed.step if resumed else 0, n, error)
            if error is None:
                self.record(n, "main", state, n / 1000)
                committed.append(n)
        now = self.list_steps()
        retired: set[int] = set()
        if committed:
            if committed[-1] not in now:
                raise Violation(f"save(step={committed[-1]}) as a second user reported "
                                f"success, but list() names only {now}")
            retired = self.retention(self.rules_main, sorted({*before, *committed[:-1]}),
                                     committed[-1], now)
        self.settle(before, retired)
        if outcome["saves"]:
            self.next_step = max(self.next_step, outcome["saves"][-1][0] + 1)

    def same_state(self, state: dict[str, Any], ckpt: Ckpt, what: str) -> None:
        try:
            assert_identical(state, ckpt.state, f"step {ckpt.step}")
        except AssertionError as exc:
            raise Violation(f"{what} returned other values than step {ckpt.step} saved "
                            f"({exc})") from None

    # -- gc, cp, loads -------------------------------------------------------------------

    @rule(delete=st.booleans(), via_cli=st.booleans())
    def gc(self, delete: bool, via_cli: bool) -> None:
        self.note("gc", locals())
        self.collect(delete, via_cli)
        self.settle(self.listed)

    def unclaimed(self) -> list[Any]:
        """The root's fingerprint without claims (a live save renews its claim any time)
        and without the directory of a save running meanwhile (its writer threads may)."""
        busy = self.in_flight

        def running(path: str) -> bool:  # under the running save's directory
            return busy is not None and busy in f"/{path}/".split("/")

        return [entry for entry in self.root.fingerprint() if "/.claim-" not in entry[0]
                and not running(entry[0])]

    def collect(self, delete: bool, via_cli: bool) -> None:
        before = self.unclaimed()
        if via_cli:
            run = run_cli("gc", self.root.url, "--grace", "0", *(["--delete"] if delete else []),
                          *options_args(self.opts))
            self.check_cli(run)
            if (run.code == 1 and self.root.local and not os.path.exists(self.root.path)
                    and "does not exist: check the path" in run.err):
                return  # nothing saved yet: the CLI names a missing root, as for a typo
            ok = run.code == 0
            if not ok and not delete:
                raise Violation(f"statereg gc (a dry run) failed: {run.err.strip()}")
        else:
            found = self.call("collect_garbage", lambda: collect_garbage(
                open_backend(self.root.url, self.opts), delete=delete, grace_s=0))
            if isinstance(found, statereg.StateregError):
                raise Violation(f"collect_garbage(delete={delete}) raised {found}")
            ok = not any(f.action.startswith("failed") for f in found)
        if not delete:
            if self.unclaimed() != before:
                raise Violation("a gc dry run changed the root")
            return
        if ok:
            left = self.call("find_leftovers", lambda: find_leftovers(
                open_backend(self.root.url, self.opts), grace_s=0))
            if isinstance(left, statereg.StateregError):
                raise Violation(f"find_leftovers raised {left}")
            doomed = [(f.path, f.kind) for f in left if f.deletable]
            if doomed:
                raise Violation(f"gc --delete succeeded, yet a dry run after it would still "
                                f"delete {doomed}")

    @rule(pick=PICK, via_cli=st.booleans())
    def cp_to_a_second_root(self, pick: int, via_cli: bool) -> None:
        self.note("cp_to_a_second_root", locals())
        step = self.pick_listed(pick)
        if step is None:
            return
        if via_cli:
            run = run_cli("cp", self.url(step), self.copy.url, *options_args(self.opts))
            self.check_cli(run)
            error = None if run.code == 0 else run.err.strip()
        else:
            got = self.call("copy_checkpoint", lambda: copy_checkpoint(
                open_backend(self.root.url, self.opts), checkpoint_name(step),
                open_backend(self.copy.url, self.opts)))
            error = got if isinstance(got, statereg.StateregError) else None
        if error is None:
            if step in self.copied:
                raise Violation(f"cp of step {step} succeeded over an existing copy")
            self.copied[step] = self.ckpts[step]
            failed = self.loads_as_saved(step, self.copy.url, self.ckpts[step])
            if failed is not None:
                raise Violation(f"cp of step {step} succeeded, but the copy does not load: "
                                f"{failed}")
        elif self.intact(step) and step not in self.copied:
            raise Violation(f"cp of step {step}, which is intact, failed: {error}")
        self.settle(self.listed)

    @rule(pick=PICK, verify=st.sampled_from(["off", "fast", "full"]))
    def load_by_step(self, pick: int, verify: str) -> None:
        self.note("load_by_step", locals())
        step = self.pick_listed(pick)
        if step is None:
            return
        mgr = self.mgr("plain")
        got = self.call(f"load(step={step}, verify={verify!r})",
                        lambda: mgr.load(step=step, verify=verify))  # type: ignore[arg-type]
        if isinstance(got, statereg.StateregError):
            if self.intact(step):
                raise Violation(f"load(step={step}, verify={verify!r}) of an intact "
                                f"checkpoint failed: {got}")
        elif verify != "off" or self.intact(step):  # "off" reads damage unchecked, as documented
            self.same(self.main, self.ckpts[step], f"load(step={step}, verify={verify!r})")
        self.settle(self.listed)

    @rule()
    def resume(self) -> None:
        self.note("resume", locals())
        self.check_resume(self.mgr("plain"), self.main)
        self.settle(self.listed)

    @rule(pick=PICK, command=st.sampled_from(["verify", "inspect", "inspect model", "ls",
                                              "export-hf"]))
    def cli_reads(self, pick: int, command: str) -> None:
        self.note("cli_reads", locals())
        step = self.pick_listed(pick)
        if step is None:
            return
        url, opts = self.url(step), options_args(self.opts)
        if command == "verify":
            run = run_cli("verify", url, *opts)
            self.check_cli(run)
            if (run.code == 0) != self.intact(step):
                raise Violation(f"statereg verify {url} exited {run.code} "
                                f"({run.err.strip()}), but the checkpoint is "
                                f"{'intact' if self.intact(step) else 'damaged'}")
        elif command.startswith("inspect"):
            self.check_cli(run_cli("inspect", url + ("/model" if " " in command else ""),
                                   *opts))
        elif command == "ls":
            run = run_cli("ls", self.root.url, *opts)
            self.check_cli(run)
        else:
            with tempfile.TemporaryDirectory() as out:
                run = run_cli("export-hf", url, f"{out}/hf", *opts)
                self.check_cli(run)
                if run.code == 0:
                    self.exported_as_saved(f"{out}/hf", step)
                elif self.intact(step):
                    raise Violation(f"export-hf of intact step {step} failed: {run.err}")
        self.settle(self.listed)

    def exported_as_saved(self, out: str, step: int) -> None:
        from safetensors.torch import load_file

        tensors: dict[str, torch.Tensor] = {}
        for name in sorted(os.listdir(out)):
            if name.endswith(".safetensors"):
                tensors.update(load_file(os.path.join(out, name)))
        try:
            assert_identical(tensors, self.ckpts[step].state["model"], f"export of {step}")
        except AssertionError as exc:
            raise Violation(f"export-hf of step {step} exited 0 with other tensors ({exc})") \
                from None


# -- running it ------------------------------------------------------------------------------


def run_model(env: Env, examples: int) -> None:
    machine = type(f"StorageModel_{env.kind.replace('-', '_')}", (StorageModel,), {"env": env})
    if SEED is not None:
        machine = hypothesis_seed(int(SEED))(machine)
    count = int(os.environ.get("STATEREG_MODEL_EXAMPLES", examples))
    run_state_machine_as_test(machine, settings=settings(
        max_examples=count, stateful_step_count=STEPS, deadline=None,
        derandomize=SEED is None, database=None, print_blob=True,
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.verbose if os.environ.get("STATEREG_MODEL_VERBOSE")
        else Verbosity.normal))


@pytest.fixture
def quiet() -> Iterator[None]:
    """Thousands of saves log thousands of warnings about the damage done on purpose."""
    logging.disable(logging.CRITICAL)
    torch.set_num_threads(1)
    yield
    logging.disable(logging.NOTSET)


def local_env(tmp_path: Any) -> Env:
    """Roots on local disk, in a folder a second user can reach (restart_as_another_user):
    pytest's own temporary folders are root's alone. $STATEREG_MODEL_ROOTS picks where
    (long runs: on tmpfs), else the system's temporary folder."""
    from fsspec.implementations.local import LocalFileSystem

    base = tempfile.mkdtemp(prefix="statereg-model-", dir=os.environ.get("STATEREG_MODEL_ROOTS"))
    os.chmod(base, 0o755)
    atexit.register(shutil.rmtree, base, True)

    def make_root(name: str) -> Root:
        path = f"{base}/{name}"
        return Root(path, {}, LocalFileSystem(), path, local=True)

    return Env("local", make_root)


def test_model_on_local_disk(tmp_path, quiet):
    run_model(local_env(tmp_path), CI_EXAMPLES["local"])


def shm_env(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Env:
    """A memory root (shm://, records without CRC-32s) whose copies go to local disk, where
    each record gets its CRC-32s on the way (engine/transfer.py)."""
    from fsspec.implementations.local import LocalFileSystem

    from statereg.backends.shm import SharedMemoryBackend

    base = tempfile.mkdtemp(prefix="statereg-test-model-", dir="/dev/shm"
                            if os.access("/dev/shm", os.W_OK) else str(tmp_path))
    monkeypatch.setenv("STATEREG_SHM_DIR", base)
    monkeypatch.setenv("STATEREG_NODE", "node0")

    def make_root(name: str) -> Root:
        if name.startswith("copy-"):
            return local_env(tmp_path).make_root(name)
        backend = SharedMemoryBackend(f"shm://{name}")
        backend.make_private()
        return Root(backend.url, {}, LocalFileSystem(), backend.root, local=True)

    return Env("shm", make_root)


def test_model_on_shm_copied_to_disk(tmp_path, quiet, monkeypatch):
    env = shm_env(tmp_path, monkeypatch)
    try:
        run_model(env, CI_EXAMPLES["shm"])
    finally:
        shutil.rmtree(os.environ["STATEREG_SHM_DIR"], ignore_errors=True)


def s3_env(kind: str, endpoint: str, admin: Any) -> Env:
    bucket = new_bucket(admin)

    def make_root(name: str) -> Root:
        return Root(f"s3://{bucket}/{name}", s3_options(endpoint), admin, f"{bucket}/{name}",
                    local=False)

    return Env(kind, make_root)


def test_model_on_s3(s3_server, s3_admin, quiet):
    run_model(s3_env("s3", s3_server.endpoint, s3_admin), CI_EXAMPLES["s3"])


def test_model_on_a_store_that_ignores_conditional_creates(condition_ignoring_proxy, s3_admin,
                                                           quiet):
    run_model(s3_env("no-conditional-s3", condition_ignoring_proxy.endpoint, s3_admin),
              CI_EXAMPLES["no-conditional-s3"])



# -- shrunk sequences, replayed: one per distinct failure the model found (on the code of
# issue 25, and in long runs since); each failed before its fix --------------------------------


def replay(tmp_path: Any, main: dict[str, Any], *steps: tuple[str, dict[str, Any]],
           other: dict[str, Any] | None = None, other_mode: str = "plain") -> None:
    """Run `steps` (rule name, arguments) on local disk, checking the invariant after each."""
    machine = type("Replay", (StorageModel,), {"env": local_env(tmp_path)})()
    try:
        machine.configure(main=main, other=other or {}, other_mode=other_mode)
        machine.every_listed_checkpoint_loads_or_is_reported_damaged()
        for name, kwargs in steps:
            getattr(machine, name)(**kwargs)
            machine.every_listed_checkpoint_loads_or_is_reported_damaged()
    finally:
        machine.teardown()


SAVE = ("save", {"mode": "plain", "train": True, "level": 1})
SAVE_INCREMENTAL = ("save", {"mode": "incremental", "train": True, "level": 1})


@pytest.mark.parametrize("how", ["truncate", "delete"])
def test_regression_retention_keeps_intact_older_than_damaged_newer(tmp_path, quiet, how):
    # step 2's first tensor file (deps sorted: model/.metadata, model/__0_0.distcp, ...)
    replay(tmp_path, {"keep_last": 2}, SAVE, SAVE,
           ("damage_a_file", {"pick": 1, "file": 1, "how": how, "where": 0.5}), SAVE)


def test_regression_incremental_reuse_never_spreads_a_damaged_base(tmp_path, quiet):
    # Step 2 references step 1's base; a byte of it flips; step 3 references it again.
    replay(tmp_path, {"keep_last": 3}, SAVE_INCREMENTAL, SAVE_INCREMENTAL,
           ("damage_a_file", {"pick": 0, "file": 1, "how": "flip", "where": 0.5}),
           SAVE_INCREMENTAL)


def test_regression_gc_keeps_the_base_a_running_incremental_save_named(tmp_path, quiet):
    replay(tmp_path, {"keep_last": 1}, SAVE_INCREMENTAL,
           ("save_while_others_work", {"during": ["second writer saves", "gc --delete"],
                                       "train": False}),
           other={"keep_last": 1})


def test_regression_gc_dry_run_and_delete_agree_on_a_base_whose_referenced_file_is_gone(
        tmp_path, quiet):
    # Step 2 references step 1's base, which retention uncommitted (its marker and the
    # referenced file stay); that file is deleted. The dry run called the directory
    # deletable (no file present is referenced), `--delete` kept it (a reference still
    # points into it) and exited 0 (seed 101, 100 sequences).
    replay(tmp_path, {"keep_last": 1}, SAVE_INCREMENTAL, SAVE_INCREMENTAL,
           ("damage_a_file", {"pick": 0, "file": 0, "how": "delete", "where": 0.0}),
           ("gc", {"delete": True, "via_cli": True}))


def test_regression_a_second_flip_at_the_same_place_does_not_repair_the_file(tmp_path, quiet):
    # The model's own defect (seed 3004, 0583b0c): a flip was an XOR, so two rots of step 1's
    # reused base at one place restored it; `verify` passed it, as it should, and the model,
    # which records damage and never repair, reported a violation.
    rot = ("rot_a_reused_file_then_save_incremental", {"where": 0.9, "saves": 0})
    replay(tmp_path, {"keep_last": 2}, SAVE_INCREMENTAL, SAVE_INCREMENTAL, rot, rot,
           ("cli_reads", {"pick": 0, "command": "verify"}))


@pytest.mark.parametrize("how", ["link", "fifo"])
def test_regression_gc_delete_removes_a_planted_claim_or_fails(tmp_path, quiet, how):
    replay(tmp_path, {"keep_last": 1}, ("plant_a_claim", {"how": how, "ahead": 0}),
           ("gc", {"delete": True, "via_cli": True}))


def test_regression_a_save_commits_only_a_manifest_readers_accept(tmp_path, quiet):
    replay(tmp_path, {"keep_last": 1}, ("save_with_bad_arguments",
                                        {"which": "huge tokens_seen"}), SAVE)


def test_regression_a_huge_int_in_extra_is_a_spec_error(tmp_path, quiet):
    replay(tmp_path, {"keep_last": 1}, ("save_with_bad_arguments",
                                        {"which": "huge int in extra"}))


def test_regression_load_verify_off_of_a_missing_file_is_a_statereg_error(tmp_path, quiet):
    replay(tmp_path, {"keep_last": 1}, SAVE,
           ("damage_a_file", {"pick": 0, "file": 1, "how": "delete", "where": 0.5}),
           ("load_by_step", {"pick": 0, "verify": "off"}))


def test_regression_export_hf_of_a_missing_file_is_a_statereg_error(tmp_path, quiet):
    replay(tmp_path, {"keep_last": 1}, SAVE,
           ("damage_a_file", {"pick": 0, "file": 1, "how": "delete", "where": 0.5}),
           ("cli_reads", {"pick": 0, "command": "export-hf"}))


@pytest.mark.parametrize("how", ["link", "fifo"])
@pytest.mark.parametrize("via_cli", [True, False])
def test_regression_one_special_manifest_does_not_fail_gc_for_the_root(tmp_path, quiet, how,
                                                                         via_cli):
    replay(tmp_path, {"keep_last": 2}, SAVE, SAVE,
           ("damage_a_manifest", {"pick": 0, "which": "manifest.json", "how": how, "to": 1}),
           ("gc", {"delete": False, "via_cli": via_cli}))


def test_regression_a_claim_another_thread_is_still_taking_is_live(tmp_path, quiet):
    """What the model's two_writers_race_for_one_step found by timing, made deterministic:
    saver A stops right after creating its claim; saver B of the same step must be refused."""
    root = str(tmp_path / "run")
    a, b = Live(1), Live(2)
    mgr_a = statereg.CheckpointManager(declaration(root, {}), **a.objects())
    mgr_b = statereg.CheckpointManager(declaration(root, {}), **b.objects())
    created, go = threading.Event(), threading.Event()
    backend = mgr_a._backend
    original = backend.create_bytes

    def create_bytes(path: str, data: bytes) -> Any:
        done = original(path, data)
        if "/.claim-" in path and threading.current_thread().name == "saver-a":
            created.set()
            go.wait(30)
        return done

    backend.create_bytes = create_bytes  # type: ignore[method-assign]
    results: dict[str, Any] = {}
    saver = threading.Thread(target=lambda: results.setdefault("a", StorageModel.call(
        "save", lambda: mgr_a.save(step=1))), name="saver-a")
    saver.start()
    try:
        assert created.wait(30)
        refused = StorageModel.call("save", lambda: mgr_b.save(step=1))
    finally:
        go.set()
        saver.join(60)
    assert isinstance(refused, statereg.CheckpointInProgressError), refused
    assert not isinstance(results["a"], statereg.StateregError), results["a"]
    fresh = Live(99)
    statereg.CheckpointManager(declaration(root, {}), **fresh.objects()).load(step=1)
    assert_identical(fresh.snapshot()["model"], a.snapshot()["model"])


def test_regression_a_resume_after_an_unverified_damaged_load_holds_only_the_saved_keys(
        tmp_path, quiet):
    # Seed 5039 (410d3cf): load(verify="off") of a checkpoint whose scheduler state.json had
    # a flipped byte in a key merged a key into the live scheduler (torch's load_state_dict
    # updates __dict__); the next resume kept it beside the saved keys.
    replay(tmp_path, {"keep_last": 3, "keep_best": {"metric": "loss", "mode": "min", "count": 1}},
           ("cp_to_a_second_root", {"pick": 37, "via_cli": False}),
           ("rot_a_reused_file_then_save_incremental", {"saves": 2, "where": 0.0}),
           ("save_with_bad_arguments", {"which": "huge step"}),
           ("damage_a_file", {"file": 59, "how": "truncate", "pick": 20, "where": 0.0}),
           ("save_with_bad_arguments", {"which": "huge step"}),
           ("resume", {}),
           ("damage_a_file", {"file": 62, "how": "flip", "pick": 0, "where": 0.9}),
           ("rot_a_reused_file_then_save_incremental", {"saves": 1, "where": 0.9}),
           ("load_by_step", {"pick": 50, "verify": "off"}),
           ("cp_to_a_second_root", {"pick": 33, "via_cli": False}),
           ("resume", {}))


# -- liveness (issue 41): each replays a sequence the new rules reach -------------------------


@pytest.mark.parametrize("how", ["truncate", "flip", "manifest.sum"])
def test_regression_a_restart_past_a_damaged_newest_checkpoint_saves_its_step_again(
        tmp_path, quiet, how):
    # Issue 41, case 1: on every restart, save(2) raised CheckpointExistsError.
    replay(tmp_path, {"keep_last": 2}, SAVE, SAVE,
           ("damage_the_newest_then_restart", {"file": 1, "how": how, "where": 0.5,
                                               "mode": "plain", "saves": 1}),
           ("restart_and_go_on", {"mode": "incremental", "saves": 1}))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")
def test_regression_another_users_entries_never_stop_a_restart(tmp_path, quiet):
    # Issue 41, case 2: one unreadable folder failed the resume for the whole root.
    replay(tmp_path, {"keep_last": 1}, SAVE,
           ("restart_as_another_user", {"what": "leftover", "saves": 2}),
           ("restart_as_another_user", {"what": "retired leftover", "saves": 1}),
           ("restart_as_another_user", {"what": "file", "saves": 1}), SAVE)


def test_regression_a_damaged_manifest_above_never_blocks_the_resave_of_a_damaged_step(
        tmp_path, quiet):
    # Seeds 4101 and 4102 of the first long run with the liveness rules: step 3's manifest
    # a FIFO, step 2 damaged; the restart resumed from 1 and its save(2) was refused, since
    # step 3's unreadable manifest "may reference" step 2's files. A damaged manifest (not
    # its sum) references nothing that loads: the save retires step 2, then step 3.
    replay(tmp_path, {"keep_last": 3}, SAVE, SAVE, SAVE,
           ("damage_a_manifest", {"pick": -1, "which": "manifest.json", "how": "fifo",
                                  "to": 0}),
           ("damage_a_file", {"pick": -1, "file": 1, "how": "truncate", "where": 0.5}),
           ("restart_and_go_on", {"mode": "plain", "saves": 2}))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")
def test_regression_another_users_entry_goes_past_a_planted_claim(tmp_path, quiet):
    # The model's own defect (seed 4205): another user's file was planted over the
    # directory of a planted claim (IsADirectoryError in the test, not in statereg).
    replay(tmp_path, {"keep_last": 1}, ("plant_a_claim", {"how": "link", "ahead": 0}),
           ("restart_as_another_user", {"what": "file", "saves": 1}))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")
def test_regression_a_killed_saves_claim_is_stale_to_a_restart_as_another_user(tmp_path, quiet):
    # The model's own defect (seed 4404): the claim a killed save left named this test's
    # process, alive, so the second user's restart found step 2 "being saved".
    replay(tmp_path, {"keep_last": 1}, SAVE,
           ("save_killed", {"mode": "plain", "point": "before_first_file", "train": False}),
           ("restart_as_another_user", {"what": "leftover", "saves": 1}))


@pytest.mark.parametrize("delete", [False, True])
def test_regression_gc_of_a_root_nothing_was_saved_to_names_it_missing(tmp_path, quiet, delete):
    # Seed 9900 (ff19ddf): `statereg gc` on a local root that does not exist yet now exits 1
    # naming it (a typo'd root must not look empty); the model took that for a failed gc.
    replay(tmp_path, {"keep_last": 1}, ("gc", {"delete": delete, "via_cli": True}))


def test_regression_a_save_that_replaced_a_damaged_readers_files_may_drop_it(tmp_path, quiet):
    # Seed 8009 (586a99b): step 6 (the second writer's) references step 5's retired base,
    # whose file then rots; the run resumes from 4 and saves 5, which replaces that file
    # (a damaged reader keeps nothing); 6 then lists as damaged. The model still counted
    # 6 as one a listing calls intact and took its absence for retention deleting it.
    replay(tmp_path, {"keep_last": 1, "keep_every": 2},
           ("restart_as_another_user", {"saves": 1, "what": "leftover"}),
           ("damage_the_newest_then_save", {"file": 0, "how": "flip", "mode": "plain",
                                            "saves": 1, "where": 0.0}),
           ("save", {"level": 0, "mode": "plain", "train": False}),
           ("save_while_others_work", {"during": ["second writer saves"] * 2, "train": False}),
           ("rot_a_reused_file_then_save_incremental", {"saves": 1, "where": 0.0}),
           ("damage_the_newest_then_restart", {"file": 0, "how": "manifest.sum",
                                               "mode": "incremental", "saves": 1, "where": 0.0}),
           other_mode="incremental")


def test_regression_a_step_a_resave_made_whole_again_is_refused_as_intact(tmp_path, quiet):
    # Seed 8103 (66614cb): step 6 (the second writer's) references step 5's file, which a
    # flip damaged; a restart resumes from 4 and saves 5 again with the same bytes, so 6 is
    # whole again, and the save of 6 is refused as over an intact checkpoint: a real cause
    # (the next restart resumes from 6). The model still counted 6 as damaged.
    replay(tmp_path, {"keep_last": 3, "keep_best": {"metric": "loss", "mode": "min",
                                                    "count": 1}},
           ("restart_as_another_user", {"saves": 2, "what": "leftover"}),
           ("resume", {}),
           ("restart_as_another_user", {"saves": 2, "what": "retired leftover"}),
           ("save_with_bad_arguments", {"which": "huge int in extra"}),
           ("save_while_others_work", {"during": ["gc --delete", "gc --delete", "gc"],
                                       "train": True}),
           ("second_writer_saves", {"level": 2, "train": True}),
           ("damage_a_file", {"file": 41, "how": "flip", "pick": 62, "where": 0.3}),
           ("restart_as_another_user", {"saves": 2, "what": "file"}),
           other_mode="incremental")


def test_regression_a_resave_with_other_bytes_of_the_same_size_hides_a_readers_damage(
        tmp_path, quiet):
    # Seed 8201 (66614cb): step 3 (the second writer's, incremental) references step 2's file,
    # which a flip damaged; the restart resumes from 1 and saves 2 again, writing that file
    # with other bytes of the same size. A listing then sees 3 whole (its load would not), so
    # retention keeps 2 and 3 and deletes 1; the model counted 3 as visibly damaged.
    replay(tmp_path, {"keep_last": 2},
           ("save_while_others_work", {"during": ["second writer saves"], "train": False}),
           ("second_writer_saves", {"level": 0, "train": False}),
           ("damage_the_newest_then_restart", {"file": 0, "how": "flip", "mode": "plain",
                                               "saves": 1, "where": 0.0}),
           other_mode="incremental")


def test_regression_readers_a_resave_made_whole_count_for_retention(tmp_path, quiet):
    # Seed 8383 (f1a6f9a): steps 4, 6 and 7 read step 4's model file; truncated, all three
    # list as damaged and the restart resumes from 2. Its save of 4 writes that file again
    # with the same bytes, so 6 and 7 list again, and retention (keep_last 2) keeps them and
    # deletes 3. The model kept to the listing before the save, where 6 and 7 were missing.
    def restart(file: int, how: str, mode: str, saves: int, where: float) -> Any:
        return ("damage_the_newest_then_restart", {"file": file, "how": how, "mode": mode,
                                                   "saves": saves, "where": where})

    def bad(which: str) -> Any:
        return ("save_with_bad_arguments", {"which": which})

    replay(tmp_path, {"keep_last": 2, "keep_every": 2},
           restart(41, "flip", "plain", 2, 0.0), bad("huge step"),
           restart(63, "manifest.sum", "plain", 2, 0.3),
           restart(45, "manifest.json", "plain", 2, 0.9),
           restart(38, "delete", "incremental", 2, 0.9),
           restart(22, "flip", "incremental", 2, 0.3),
           restart(26, "delete", "incremental", 1, 0.0), restart(27, "flip", "plain", 1, 0.5),
           restart(30, "flip", "incremental", 2, 0.5),
           restart(12, "delete", "async", 1, 0.9),
           restart(11, "manifest.json", "incremental", 2, 0.0),
           restart(54, "truncate", "plain", 2, 0.0))
