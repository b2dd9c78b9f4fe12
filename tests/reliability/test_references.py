"""References that nothing can break (issue 13): an incremental checkpoint's references to
earlier files survive cp, gc, another job's retention and a damaged base, on real stores."""

from __future__ import annotations

import re
import threading
from typing import Any

import pytest
import torch
from reliability_kit import assert_identical, write_manifest
from torch import nn

import statereg
import statereg.engine.save_steps
from statereg.backends.registry import open_backend
from statereg.engine.claims import Claim
from statereg.engine.gc import collect_garbage
from statereg.engine.transfer import copy_checkpoint
from statereg.errors import CheckpointDeletedError


def base_file(store: Any) -> str:
    """Step 1's base file: `step_00000001/model/__0_0.distcp`, or under the save's
    `writer-<token>/` directory on a store that does not enforce exclusive creates (the GCS
    emulator)."""
    return next(p for p in store.files()
                if p.startswith("step_00000001/") and p.endswith("model/__0_0.distcp"))


class Frozen(nn.Module):
    """A frozen base and a small head: incremental saves reference the base."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.base = nn.Linear(64, 64, bias=False).requires_grad_(False)
        self.head = nn.Linear(64, 4)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))


def manager(url: str, options: dict[str, Any], seed: int = 0, incremental: bool = True,
            **save: Any) -> tuple[Frozen, statereg.CheckpointManager]:
    model = Frozen(seed)
    spec = {"storage": {"url": url, "options": options},
            "components": {"model": {"kind": "model"}},
            "save": {"incremental": incremental, **save}}
    return model, statereg.CheckpointManager(spec, model=model)


def train(model: Frozen) -> None:
    with torch.no_grad():
        model.head.weight.add_(1.0)


def read(store: Any, relative: str) -> bytes:
    store.fs.invalidate_cache()
    return store.fs.cat_file(store.path(relative))


def flip_byte(store: Any, relative: str) -> None:
    data = bytearray(read(store, relative))
    data[len(data) // 2] ^= 0x01
    store.fs.pipe_file(store.path(relative), bytes(data))


def loaded(url: str, options: dict[str, Any], step: int) -> dict[str, torch.Tensor]:
    model, mgr = manager(url, options, seed=12345)
    mgr.load(step=step, verify="full")
    return model.state_dict()


def test_cp_of_an_incremental_checkpoint_never_writes_into_a_committed_one(store):
    a, b = f"{store.url}/a", f"{store.url}/b"
    model_a, mgr_a = manager(a, store.options)
    mgr_a.save(step=1)
    train(model_a)
    mgr_a.save(step=2)
    model_b, mgr_b = manager(b, store.options, seed=99)
    mgr_b.save(step=1)
    before = {p: read(store, p) for p in store.files() if p.startswith("b/step_00000001/")}

    manifest = copy_checkpoint(open_backend(a, store.options), "step_00000002",
                               open_backend(b, store.options))

    # B's own step 1 is untouched, and the copy is self-contained.
    assert {p: read(store, p) for p in before} == before
    assert not [p for p in store.files()
                if p.startswith("b/step_00000001/") and p not in before]
    assert manifest.references == []
    assert_identical(loaded(b, store.options, 1), model_b.state_dict())
    assert_identical(loaded(b, store.options, 2), model_a.state_dict())
    # The copy keeps the source's codec: rewriting does not change what was stored.
    assert {f.codec for f in manifest.files} == {"none"}


@pytest.mark.parametrize("damage", ["flipped bit", "newer major version"])
def test_retention_keeps_what_an_unreadable_manifest_may_reference(store, damage):
    _, mine = manager(store.url, store.options)
    mine.save(step=1)
    model, mine = manager(store.url, store.options)
    train(model)
    mine.save(step=2)  # references step 1's base
    backend = open_backend(store.url, store.options)
    if damage == "flipped bit":
        data = bytearray(read(store, "step_00000002/manifest.json"))
        data[0] ^= 0x01  # '{' -> 'z': not JSON any more
        store.fs.pipe_file(store.path("step_00000002/manifest.json"), bytes(data))
    else:
        data = re.sub(rb'"format_version": "1\.[12]"', b'"format_version": "2.0"',
                      read(store, "step_00000002/manifest.json"))
        write_manifest(backend, "step_00000002", data)
    base = read(store, base_file(store))

    # Another job on the same root, keeping one checkpoint, saves and applies retention.
    _, other = manager(store.url, store.options, seed=7, incremental=False, keep_last=1)
    other.save(step=3)

    assert read(store, base_file(store)) == base
    assert "step_00000001/manifest.json" in store.files()  # nothing of step 1 was deleted
    assert "step_00000002/manifest.json" in store.files()  # nor the unreadable one


def test_gc_keeps_what_an_unreadable_manifest_may_reference(store):
    _, mgr = manager(store.url, store.options, keep_last=1)
    mgr.save(step=1)
    model, mgr = manager(store.url, store.options, keep_last=1)
    train(model)
    mgr.save(step=2)  # retention uncommits step 1 and keeps the base step 2 references
    assert "step_00000001/manifest.json" not in store.files()
    base = base_file(store)
    data = bytearray(read(store, "step_00000002/manifest.json"))
    data[0] ^= 0x01
    store.fs.pipe_file(store.path("step_00000002/manifest.json"), bytes(data))

    found = collect_garbage(open_backend(store.url, store.options), delete=True, grace_s=0)

    assert base in store.files()
    kept = {f.path: f.action for f in found}
    assert "cannot be read" in kept["step_00000001"] and "step_00000002" in kept["step_00000001"]


def run_during_write(monkeypatch: pytest.MonkeyPatch, action: Any) -> None:
    """Run `action` in another thread once the next save has written its data files: what a
    second process does meanwhile (the thread makes this process's claim look like a live
    save's, as another process's would)."""
    write = statereg.engine.save_steps.write_components

    def write_then_act(*args: Any, **kwargs: Any) -> Any:
        files = write(*args, **kwargs)
        monkeypatch.setattr(statereg.engine.save_steps, "write_components", write)
        errors: list[BaseException] = []

        def act() -> None:
            try:
                action()
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=act)
        thread.start()
        thread.join()
        if errors:
            raise errors[0]
        return files

    monkeypatch.setattr(statereg.engine.save_steps, "write_components", write_then_act)


def test_another_jobs_retention_keeps_the_files_a_running_save_reuses(store, monkeypatch):
    model, mine = manager(store.url, store.options)
    mine.save(step=11)
    train(model)
    _, other = manager(store.url, store.options, seed=7, incremental=False, keep_last=1)
    run_during_write(monkeypatch, lambda: other.save(step=20))

    mine.save(step=12)  # reuses step 11's base while the other job's retention deletes step 11

    assert "step_00000011/manifest.json" not in store.files()
    assert_identical(loaded(store.url, store.options, 12), model.state_dict())


def test_gc_keeps_the_base_a_running_save_reuses_after_another_retention_uncommitted_it(
        store, monkeypatch):
    """Issue 25, case 3: while step 12 reuses step 11, another job's retention uncommits
    step 11 (keeping its files for the claim), then gc runs: it keeps them too."""
    model, mine = manager(store.url, store.options)
    mine.save(step=11)
    train(model)
    _, other = manager(store.url, store.options, seed=7, incremental=False, keep_last=1)
    found: dict[str, str] = {}

    def retention_then_gc() -> None:
        other.save(step=20)
        assert "step_00000011/manifest.json" not in store.files()
        backend = open_backend(store.url, store.options)
        found.update({f.path: f.action for f in collect_garbage(backend, delete=True,
                                                                  grace_s=0)})

    run_during_write(monkeypatch, retention_then_gc)
    mine.save(step=12)

    assert found["step_00000011"].startswith(
        "keep: a running incremental save reuses step_00000011"), found
    assert any(re.fullmatch(r"step_00000011/(writer-[0-9a-f]{32}/)?model/__0_0\.distcp", p)
               for p in store.files())
    assert_identical(loaded(store.url, store.options, 12), model.state_dict())


def test_a_save_whose_referenced_files_vanished_commits_nothing(store, monkeypatch):
    model, mine = manager(store.url, store.options)
    mine.save(step=11)
    train(model)
    # Deleted by hand (or by a statereg that does not read claims) while step 12 is written.
    run_during_write(monkeypatch, lambda: store.fs.rm(store.path("step_00000011"),
                                                      recursive=True))

    with pytest.raises(CheckpointDeletedError,
                       match=r"step_00000011/(writer-[0-9a-f]{32}/)?model/__0_0\.distcp.*was "
                             "deleted while the save ran"):
        mine.save(step=12)
    assert "step_00000012/manifest.json" not in store.files()
    mine.save(step=13)  # the next save writes the base itself
    assert_identical(loaded(store.url, store.options, 13), model.state_dict())


@pytest.mark.parametrize("flipped_after", [1, 2], ids=["before-first-reuse", "after-first-reuse"])
def test_a_damaged_base_is_never_referenced_again_and_every_later_save_loads(
        store, flipped_after, caplog):
    """Issue 25, case 2: a byte of the base flips after the save of step `flipped_after`
    (2: after step 2 already referenced it once). Every later save re-verifies what it
    references, writes the base's tensors itself from memory, and loads bit for bit."""
    model, mgr = manager(store.url, store.options, keep_last=3)
    for n in range(1, flipped_after + 1):
        train(model)
        mgr.save(step=n)
    base = base_file(store)
    flip_byte(store, base)

    for n in range(flipped_after + 1, 6):
        train(model)
        manifest = statereg.verify(mgr.save(step=n), store.options)
        assert not [r for r in manifest.references if r.path == base]
        assert_identical(loaded(store.url, store.options, n), model.state_dict())

    assert f"{base}: checksum" in caplog.text and "writes the tensors stored there itself" \
        in caplog.text
    # Only the first save after the damage wrote the base again; the next ones reference it.
    first = f"step_{flipped_after + 1:08d}/"
    assert [r.path for r in statereg.verify(f"{store.url}/step_00000005", store.options)
            .references if r.path.startswith(first)]


def test_a_base_uncommitted_just_before_the_claim_named_it_is_not_used(store, monkeypatch):
    model, mgr = manager(store.url, store.options)
    mgr.save(step=10)
    train(model)
    mgr.save(step=11)  # step 12 changes nothing: with step 11 as base it would reference it
    hold = Claim.hold

    def hold_then_lose_it(self: Claim, name: str) -> None:
        hold(self, name)
        if name == "step_00000011":  # another job's retention uncommitted it meanwhile
            store.fs.rm(store.path("step_00000011/manifest.json"))

    monkeypatch.setattr(Claim, "hold", hold_then_lose_it)
    manifest = statereg.verify(mgr.save(step=12), store.options)

    assert {r.path.split("/", 1)[0] for r in manifest.references} == {"step_00000010"}
    assert_identical(loaded(store.url, store.options, 12), model.state_dict())
