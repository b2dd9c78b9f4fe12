"""`statereg gc ROOT`: lists leftovers of interrupted saves (dry run by default), removes
them with --delete, keeps anything a save may still be writing, never touches a checkpoint
with a manifest. On local disk and on the S3 server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import crash_driver
import pytest
from crash_driver import SINGLE_COMPONENTS, TinyState, declaration
from reliability_kit import KILLED, assert_identical, committed_names, run_child

import statereg
from statereg.backends.registry import open_backend
from statereg.cli import main as cli
from statereg.engine import claims as claims_module
from statereg.engine.claims import claim_file
from statereg.engine.gc import collect_garbage, find_leftovers

BACKENDS = ["local", "s3"]


def saved_root(store, steps=(1, 2)):
    """A root with committed `steps`, as a backend."""
    for step in steps:
        statereg.CheckpointManager(declaration(store.url, store.options, SINGLE_COMPONENTS),
                                   **TinyState.trained(step).objects()).save(step=step)
    return open_backend(store.url, store.options)


def plant(backend, files: dict[str, bytes]) -> None:
    for path, data in files.items():
        backend.write_bytes(path, data)


def claim_json(**changes) -> bytes:
    now = time.time()
    info = {"token": "t" * 32, "host": "elsewhere", "host_id": "0" * 16, "pid": 1,
            "thread": "MainThread", "started_at": now, "renewed_at": now, "lease_s": 120.0}
    info.update(changes)
    return json.dumps(info).encode()


def snapshot(store) -> dict[str, bytes]:
    committed = set(committed_names(store.url, store.options))
    return {p: store.fs.cat_file(store.path(p)) for p in store.files()
            if p.split("/")[0] in committed}


@pytest.mark.parametrize("store", BACKENDS, indirect=True)
def test_dry_run_lists_leftovers_with_sizes_and_deletes_nothing(store, capsys):
    backend = saved_root(store)
    plant(backend, {"step_00000003/model/__0_0.distcp": b"x" * 300,
                    "step_00000003/rng/rank_00000.json": b"{}"})
    before = store.files()
    options = ["--options", json.dumps(store.options)]

    assert cli(["gc", store.url, "--grace", "0", *options]) == 0
    out = capsys.readouterr().out
    assert store.files() == before
    line = next(x for x in out.splitlines() if x.startswith("step_00000003"))
    assert "uncommitted checkpoint" in line and "302 B" in line and "delete" in line
    assert "step_00000001" not in out and "step_00000002" not in out
    assert "dry run: 1 of 1 leftovers (302 B) would be deleted" in out

    assert cli(["gc", store.url, "--grace", "0", "--delete", *options]) == 0
    assert "deleted 1 of 1 leftovers" in capsys.readouterr().out
    assert not [p for p in store.files() if p.startswith("step_00000003")]
    assert committed_names(store.url, store.options) == ["step_00000001", "step_00000002"]


@pytest.mark.parametrize("store", BACKENDS, indirect=True)
def test_committed_checkpoints_are_never_touched(store):
    backend = saved_root(store, steps=(1, 2, 3))
    # Odd things inside committed directories stay too: gc only judges whole directories.
    plant(backend, {"step_00000002/stray.bin": b"?", f"step_00000003/{claim_file(0)}":
                    claim_json(renewed_at=0)})
    # A manifest that does not parse (damaged, or from a newer statereg) is never removed.
    plant(backend, {"step_00000004/manifest.json": b'{"format_version": "9.0"}',
                    "step_00000004/model/__0_0.distcp": b"x"})
    before = snapshot(store)

    found = collect_garbage(backend, delete=True, grace_s=0)

    assert [(f.path, f.kind) for f in found] == [("step_00000004", "unparsable manifest")]
    assert found[0].action.startswith("keep: manifest.json exists but does not parse")
    assert snapshot(store) == before
    assert "step_00000004/model/__0_0.distcp" in store.files()
    for name in ("step_00000001", "step_00000002", "step_00000003"):
        statereg.verify(f"{store.url}/{name}", store.options)


@pytest.mark.parametrize("store", BACKENDS, indirect=True)
def test_leftovers_younger_than_the_grace_period_are_kept(store, capsys):
    backend = saved_root(store, steps=(1,))
    plant(backend, {"step_00000002/model/__0_0.distcp": b"x" * 10,
                    "latest.tmp-123-0badcafe": b"step_00000002"})

    found = collect_garbage(backend, delete=True)  # default grace: one hour
    assert {f.path for f in found} == {"step_00000002", "latest.tmp-123-0badcafe"}
    assert all(f.action.startswith("keep: younger than the grace period") for f in found)
    assert "step_00000002/model/__0_0.distcp" in store.files()

    later = time.time() + 2 * 3600
    assert all(f.action == "delete" for f in find_leftovers(backend, now=later))
    assert cli(["gc", store.url, "--grace", "30m", "--options", json.dumps(store.options)]) == 0
    assert "younger than the grace period (1800 s)" in capsys.readouterr().out


@pytest.mark.parametrize("store", BACKENDS, indirect=True)
def test_a_directory_a_live_save_holds_is_kept_whatever_its_age(store):
    backend = saved_root(store, steps=(1,))
    # A live process on this machine, renewing its claim: a save in flight.
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        host = claims_module._HOST_ID
        plant(backend, {
            f"step_00000002/{claim_file(0)}": claim_json(host_id=host, pid=sleeper.pid),
            "step_00000002/model/__0_0.distcp": b"x",
            # Another machine renewed its claim a moment ago: in flight too.
            f"step_00000003/{claim_file(4)}": claim_json(host="trainer-2"),
            "step_00000003/model/__0_0.distcp": b"x",
            # Another machine, silent for longer than its lease: that save died.
            f"step_00000004/{claim_file(0)}": claim_json(renewed_at=time.time() - 600),
            "step_00000004/model/__0_0.distcp": b"x",
        })

        found = {f.path: f.action for f in collect_garbage(backend, delete=True, grace_s=0)}

        assert found["step_00000002"].startswith(
            f"keep: a save holds it (process {sleeper.pid} on ")
        assert found["step_00000003"].startswith("keep: a save holds it (process 1 on trainer-2")
        assert found["step_00000004"] == "deleted"
        assert "step_00000002/model/__0_0.distcp" in store.files()
        assert "step_00000003/model/__0_0.distcp" in store.files()
    finally:
        sleeper.kill()
        sleeper.wait()
    # Its process gone, the claim no longer protects the directory.
    found = {f.path: f.action for f in collect_garbage(backend, delete=True, grace_s=0)}
    assert found["step_00000002"] == "deleted"
    assert committed_names(store.url, store.options) == ["step_00000001"]


def test_a_save_of_a_step_a_live_claim_holds_is_refused_naming_the_holder(store_local):
    backend = saved_root(store_local, steps=(1,))
    plant(backend, {f"step_00000002/{claim_file(0)}": claim_json(host="trainer-7", pid=4242)})
    mgr = statereg.CheckpointManager(
        declaration(store_local.url, {}, SINGLE_COMPONENTS), **TinyState.trained(2).objects())

    with pytest.raises(statereg.CheckpointInProgressError) as info:
        mgr.save(step=2)
    assert "is being saved by process 4242 on trainer-7" in str(info.value)
    assert isinstance(info.value, statereg.CheckpointExistsError)

    # Once the holder stops renewing for longer than its lease, the claim is taken over.
    plant(backend, {f"step_00000002/{claim_file(0)}": claim_json(renewed_at=0)})
    mgr.save(step=2)
    assert committed_names(store_local.url, {}) == ["step_00000001", "step_00000002"]
    assert not [p for p in os.listdir(f"{store_local.url}/step_00000002") if "claim" in p]


@pytest.mark.parametrize("store", BACKENDS, indirect=True)
def test_the_next_retention_finishes_what_a_killed_retention_left(store, tmp_path):
    """Issue 25, case 9: a retention killed after it uncommitted step 1 leaves its files;
    the next save's retention deletes them (no gc needed)."""
    marker = tmp_path / "reached"
    code = run_child(crash_driver.single, store.url, store.options, "mid_retention",
                     str(marker))
    assert code == KILLED and marker.read_text() == "mid_retention"
    assert "step_00000001/manifest.json" not in store.files()
    assert [p for p in store.files() if p.startswith("step_00000001/")]

    statereg.CheckpointManager(declaration(store.url, store.options, SINGLE_COMPONENTS, 1),
                               **TinyState.trained(3).objects()).save(step=3)

    assert not [p for p in store.files() if p.startswith("step_00000001/")]
    assert committed_names(store.url, store.options) == ["step_00000003"]


def test_gc_rejects_a_bad_grace_and_reports_an_empty_root(tmp_path, capsys):
    assert cli(["gc", str(tmp_path), "--grace", "soon"]) == 2
    assert "--grace 'soon'" in capsys.readouterr().err
    assert cli(["gc", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("no leftovers in")


@pytest.fixture
def store_local(tmp_path):
    class Local:
        url = str(tmp_path / "root")
        options: dict = {}

    return Local()


def _plant_hostile_claim(root: str, shape: str, outside) -> str:
    """Put `shape` where step 5's first claim goes; returns its path. `outside` is a folder
    outside the root whose contents must survive whatever statereg does."""
    path = os.path.join(root, "step_00000005", claim_file(0))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    (outside / "victim").write_bytes(b"keep me")
    if shape == "link-to-file":
        os.symlink(outside / "victim", path)
    elif shape == "link-to-directory":
        os.symlink(outside, path)
    elif shape == "dangling-link":
        os.symlink(outside / "absent", path)
    elif shape == "fifo":
        os.mkfifo(path)
    elif shape == "directory":
        os.makedirs(path)
        with open(os.path.join(path, "junk"), "wb") as f:
            f.write(b"x")
    else:
        with open(path, "wb") as f:
            f.write(b"\x00not a claim\xff")
    return path


HOSTILE_CLAIMS = ["link-to-file", "link-to-directory", "dangling-link", "fifo", "directory",
                  "garbage"]


@pytest.mark.parametrize("shape", HOSTILE_CLAIMS)
def test_a_hostile_claim_file_is_no_live_claim_and_the_save_commits(tmp_path, shape):
    """Issue 25 case 4: a `.claim-00000` that is a link, FIFO, directory or garbage made
    save(step=5) fail for good with CheckpointInProgressError. It is no claim statereg
    writes, so it never holds the step: the save commits, the entry is gone, and nothing a
    link points to is touched."""
    root, outside = str(tmp_path / "root"), tmp_path / "outside"
    outside.mkdir()
    path = _plant_hostile_claim(root, shape, outside)
    state = TinyState.trained(5)
    decl = declaration(root, {}, SINGLE_COMPONENTS)
    statereg.CheckpointManager(decl, **state.objects()).save(step=5)

    assert not os.path.lexists(path)
    assert (outside / "victim").read_bytes() == b"keep me"
    assert sorted(os.listdir(outside)) == ["victim"]
    statereg.verify(f"{root}/step_00000005")
    loaded = TinyState.trained(1)
    statereg.CheckpointManager(decl, **loaded.objects()).load(step=5)
    assert_identical(loaded.snapshot(), state.snapshot())


@pytest.mark.parametrize("shape", ["link-to-file", "fifo"])
def test_a_saver_that_listed_before_a_hostile_claim_was_removed_yields_to_the_newer_claim(
        tmp_path, shape):
    """Found by the model-based test (seed 1008): two savers of step 5 both skip a hostile
    `.claim-00000`; A claims 1 and deletes the hostile entry; B, whose listing predates A's
    claim, then creates claim 0, which is free now. B took A's claim for a leftover and both
    wrote the step (the second failed inside DCP with a raw RuntimeError). B must yield to
    the newer claim: CheckpointInProgressError, and A's claim stays."""
    root, outside = str(tmp_path / "root"), tmp_path / "outside"
    outside.mkdir()
    _plant_hostile_claim(root, shape, outside)
    backend = open_backend(root)
    name = "step_00000005"
    held, release = threading.Event(), threading.Event()
    claims = []

    def saver_a() -> None:
        claims.append(claims_module.claim_checkpoint(backend, name))
        held.set()
        release.wait(30)
        claims[0].release()

    a = threading.Thread(target=saver_a, name="saver-a")
    a.start()
    try:
        assert held.wait(30)
        assert not os.path.lexists(os.path.join(root, name, claim_file(0)))  # A deleted it

        class StaleFirstListing(type(backend)):
            """B's first listing of the step was made before A claimed it."""
            listed = False

            def list_dir(self, path=""):
                if path == name and not StaleFirstListing.listed:
                    StaleFirstListing.listed = True
                    return []
                return super().list_dir(path)

        b = StaleFirstListing(root)
        with pytest.raises(statereg.errors.CheckpointInProgressError,
                           match="is being saved by a save in thread 'saver-a'"):
            claims_module.claim_checkpoint(b, name)
        assert StaleFirstListing.listed
        assert sorted(os.listdir(os.path.join(root, name))) == [claim_file(1)]
    finally:
        release.set()
        a.join(30)


@pytest.mark.parametrize("shape", HOSTILE_CLAIMS)
def test_gc_deletes_a_directory_with_a_hostile_claim_as_its_dry_run_said(tmp_path, shape,
                                                                          capsys):
    """Issue 25 case 4: gc's dry run said it would delete such a directory, then `--delete`
    kept it and exited 0. Both agree now, and nothing outside the root is touched."""
    root, outside = str(tmp_path / "root"), tmp_path / "outside"
    outside.mkdir()
    _plant_hostile_claim(root, shape, outside)

    assert cli(["gc", root, "--grace", "0"]) == 0
    out = capsys.readouterr().out
    assert "dry run: 1 of 1 leftovers" in out and "would be deleted" in out
    assert cli(["gc", root, "--grace", "0", "--delete"]) == 0
    out = capsys.readouterr().out
    assert "deleted 1 of 1 leftovers" in out, out
    assert not os.path.lexists(os.path.join(root, "step_00000005"))
    assert (outside / "victim").read_bytes() == b"keep me"
    assert sorted(os.listdir(outside)) == ["victim"]


def test_gc_delete_exits_non_zero_when_it_cannot_delete_what_its_dry_run_listed(
        tmp_path, capsys, monkeypatch):
    """A deletion the dry run promised and that fails for any reason but a save that holds
    the directory now is a failure: one line on stderr, exit 1 (it was `keep`, exit 0)."""
    root = str(tmp_path / "root")
    plant(open_backend(root), {"step_00000003/model/__0_0.distcp": b"x"})

    def refuse(*args, **kwargs):
        raise statereg.CheckpointInProgressError("step_00000003: other saves kept claiming")

    monkeypatch.setattr("statereg.engine.gc.claim_checkpoint", refuse)
    assert cli(["gc", root, "--grace", "0", "--delete"]) == 1
    captured = capsys.readouterr()
    assert "failed: step_00000003: other saves kept claiming" in captured.out
    assert "1 deletions failed (step_00000003)" in captured.err
