"""A run always comes back and keeps saving (issue 41): damage, leftovers and other users'
entries on a root never stop a resume, nor the saves after it.

- A damaged committed checkpoint never blocks its step: a resume skips it, and the run's
  save of that step re-verifies it and, damaged, retires it (an intact one is still
  refused), on local disk, memory:// and S3 (with and without conditional creates).
- Entries the run cannot read (another user's folder, garbage) are skipped with one
  warning by listings, resume, retention, `ls` and `gc`, never failing the root; the
  other user is real (a forked child as uid 65534).
- gc finds the orphan writer directories a killed save leaves beside a committed
  checkpoint on a store without conditional creates.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from other_user import OTHER, as_other_user, needs_root, shared_root
from torch import nn

import statereg
import statereg.cli
import statereg.engine.gc
from statereg.backends.registry import open_backend
from statereg.engine.checkpoints import checkpoint_name

COMPONENTS = {"model": {"kind": "model"}}


@dataclass
class Root:
    url: str
    options: dict[str, Any]

    def manager(self, model: nn.Module, **save: Any) -> statereg.CheckpointManager:
        spec = {"storage": {"url": self.url, "options": self.options},
                "components": COMPONENTS, "save": save}
        return statereg.CheckpointManager(spec, model=model)

    def backend(self) -> Any:
        return open_backend(self.url, self.options)


@pytest.fixture(params=["local", "memory", "s3", "ignoring-s3"])
def root(request: pytest.FixtureRequest, tmp_path) -> Root:
    """A root on local disk, memory://, moto's S3, or moto behind a relay that ignores
    conditional creates (every file under a writer directory)."""
    if request.param == "local":
        return Root(str(tmp_path / "root"), {})
    if request.param == "memory":  # process-global: a fresh folder, removed afterwards
        import fsspec
        folder = f"/statereg-{uuid.uuid4().hex[:12]}"
        memory = fsspec.filesystem("memory")
        request.addfinalizer(lambda: memory.rm(folder, recursive=True)
                             if memory.exists(folder) else None)
        return Root(f"memory://{folder}", {})
    from storage_servers import new_bucket, s3_options
    bucket = new_bucket(request.getfixturevalue("s3_admin"))
    if request.param == "s3":
        return Root(f"s3://{bucket}/run", s3_options(request.getfixturevalue("s3_server")
                                                     .endpoint))
    proxy = request.getfixturevalue("condition_ignoring_proxy")
    return Root(f"s3://{bucket}/run", s3_options(proxy.endpoint))


def model_of(seed: int) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Linear(8, 8)


def data_file(root: Root, step: int) -> str:
    """Root-relative path of a data file of checkpoint `step`."""
    name = checkpoint_name(step)
    manifest = statereg.read_manifest(f"{root.url}/{name}", root.options)
    return f"{name}/" + next(f.path for f in manifest.files if f.path.endswith(".distcp"))


def truncate(root: Root, step: int) -> None:
    backend, path = root.backend(), data_file(root, step)
    backend.write_bytes(path, backend.read_bytes(path)[:-7])


def flip(root: Root, step: int) -> None:
    """One bit of a data file, its size unchanged: only a read of its bytes finds it."""
    backend, path = root.backend(), data_file(root, step)
    data = bytearray(backend.read_bytes(path))
    data[len(data) // 2] ^= 0x10
    backend.write_bytes(path, bytes(data))


def garble_manifest_sum(root: Root, step: int) -> None:
    root.backend().write_bytes(f"{checkpoint_name(step)}/manifest.sum",
                               b"xxh3_64:0123456789abcdef\n")


@pytest.mark.parametrize("damage", [truncate, flip, garble_manifest_sum])
def test_a_resume_past_a_damaged_checkpoint_saves_its_step_again(root, damage, caplog):
    """Issue 41, item 1: steps 3 and 4 committed, 4 damaged. The resume skips 4 and says
    what will happen to it; the run's save(4) retires it (a warning naming the damage) and
    commits; a restart resumes from the new step 4, with its values, and saves 5."""
    first = root.manager(model_of(1))
    first.save(3)
    first.save(4)
    first.close()
    damage(root, 4)

    with caplog.at_level(logging.WARNING, logger="statereg"):
        run = root.manager(model_of(9))
        resumed = run.load()
        assert resumed is not None and resumed.step == 3
        said = " ".join(r.getMessage() for r in caplog.records)
        assert "step_00000004" in said and "save of step 4" in said and "replaces it" in said
        caplog.clear()
        trained = model_of(2)
        run._objects["model"].load_state_dict(trained.state_dict())
        run.save(4)
        run.wait()
    retired = [r.getMessage() for r in caplog.records if "retires it" in r.getMessage()]
    assert len(retired) == 1 and "step_00000004 is damaged (" in retired[0]
    statereg.verify(f"{root.url}/step_00000004", root.options)
    again = root.manager(model_of(7))
    assert again.load().step == 4
    assert torch.equal(again._objects["model"].weight, trained.weight)
    again.save(5)
    assert [u.rsplit("/", 1)[1] for u in again.list()] == [
        "step_00000003", "step_00000004", "step_00000005"]


def test_a_save_over_an_intact_checkpoint_is_still_refused(root):
    run = root.manager(model_of(1))
    run.save(3)
    with pytest.raises(statereg.CheckpointExistsError, match="already a committed checkpoint, "
                       "and intact"):
        run.save(3)
    run.close()
    statereg.verify(f"{root.url}/step_00000003", root.options)


def test_a_damaged_checkpoint_a_committed_one_references_is_not_retired(tmp_path):
    """Retiring step 1 would delete files intact step 2 (incremental) reads: refused with
    both named, and step 2 still loads."""
    root = Root(str(tmp_path / "root"), {})
    frozen = model_of(1).requires_grad_(False)
    run = root.manager(frozen, incremental=True)
    run.save(1)
    run.save(2)
    run.close()
    root.backend().write_bytes("step_00000001/manifest.sum", b"garbage\n")
    with pytest.raises(statereg.CheckpointExistsError) as refused:
        root.manager(model_of(3)).save(1)
    assert "step_00000001 is damaged" in str(refused.value)
    assert "step_00000002" in str(refused.value)
    assert root.manager(model_of(4)).load().step == 2


# -- entries this run cannot read ------------------------------------------------------


def _unreadable_root(folder: str) -> None:
    """The second user's steps 1-2 and root's entries: step 3 (committed, then made 0700),
    a 0700 leftover at 5 and a retired 0700 one at 9, a file named like a checkpoint at 7."""
    run = Root(folder, {}).manager(model_of(1))
    for step in (1, 2, 3):
        run.save(step)
    run.close()
    for top, dirs, files in os.walk(folder):  # the run's own: the second user's
        for entry in [top] + [os.path.join(top, e) for e in dirs + files]:
            if "step_00000003" not in entry:
                os.lchown(entry, OTHER, OTHER)
    os.chmod(f"{folder}/step_00000003", 0o700)
    for step, marker in ((5, "model/__0_0.distcp"), (9, ".retired")):
        os.makedirs(os.path.dirname(f"{folder}/{checkpoint_name(step)}/{marker}"),
                    exist_ok=True)
        with open(f"{folder}/{checkpoint_name(step)}/{marker}", "w") as f:
            f.write("x")
        os.chmod(f"{folder}/{checkpoint_name(step)}", 0o700)
    with open(f"{folder}/step_00000007", "w") as f:
        f.write("not a checkpoint")


@needs_root
def test_entries_this_user_cannot_read_are_skipped_never_failing_the_root():
    """Issue 41, item 2: one unreadable folder (another user's, mode 0700) failed load(),
    list(), `ls` and `gc` for the whole root with "Permission denied ... This user may not
    write there". As uid 65534: each is skipped with one warning, the resume takes step 2,
    the run saves 4 and 6 with keep_last, `ls` lists 1, 2, 4 and `gc` reports the entries
    as kept, unreadable; a save of step 3 itself says this user cannot *read* it."""
    with shared_root() as folder:
        _unreadable_root(folder)
        records: list[logging.LogRecord] = []

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                records.append(record)

        def run() -> dict[str, Any]:
            logging.getLogger("statereg").addHandler(Keep())
            root = Root(folder, {})
            mgr = root.manager(model_of(5), keep_last=3)
            out: dict[str, Any] = {"resumed": mgr.load().step}
            out["listed"] = [u.rsplit("/", 1)[1] for u in mgr.list()]
            mgr.save(4)
            mgr.save(6)
            out["after"] = [u.rsplit("/", 1)[1] for u in mgr.list()]
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                out["ls"] = statereg.cli.main(["ls", folder])
                out["gc"] = statereg.cli.main(["gc", folder, "--delete", "--grace", "0"])
            out["printed"] = printed.getvalue()
            try:
                mgr.save(3)
                out["save3"] = "saved"
            except statereg.StateregError as exc:
                out["save3"] = f"{type(exc).__name__}: {exc}"
            out["warnings"] = [r.getMessage() for r in records if r.levelname == "WARNING"]
            return out

        got = as_other_user(run)
        for step in (3, 5, 7, 9):  # the other user's: untouched
            assert os.path.lexists(f"{folder}/{checkpoint_name(step)}")
    assert got["resumed"] == 2
    assert got["listed"] == ["step_00000001", "step_00000002"]
    assert got["after"] == ["step_00000002", "step_00000004", "step_00000006"]
    assert got["ls"] == 0 and got["gc"] == 0
    for step in (3, 5, 7):
        named = [w for w in got["warnings"] if f"step_{step:08d}:" in w and "skipping" in w]
        assert len(named) == 1, (step, got["warnings"])  # once, not at every listing
    for step in (3, 5, 7, 9):
        assert f"step_{step:08d}  unreadable entry" in got["printed"]  # gc: kept
    assert not any("retention failed" in w for w in got["warnings"]), got["warnings"]
    assert "may not read there" in got["save3"] and "may not write" not in got["save3"]
    assert all("may not write" not in w for w in got["warnings"])


@needs_root
def test_a_refused_read_is_not_called_a_write_failure():
    with shared_root() as folder:
        os.makedirs(f"{folder}/private")
        with open(f"{folder}/private/file", "w") as f:
            f.write("x")
        os.chmod(f"{folder}/private", 0o700)

        def read() -> str:
            try:
                open_backend(folder).read_bytes("private/file")
            except statereg.StorageError as exc:
                return str(exc)
            return "read"

        message = as_other_user(read)
    assert "Permission denied" in message and "may not read there" in message
    assert "may not write" not in message and "credentials" not in message


# -- orphan writer directories ---------------------------------------------------------


def test_gc_finds_and_removes_the_writer_directory_a_killed_save_left(request, tmp_path):
    """Issue 41, item 6: on a store without conditional creates, a save of step 3 killed
    after its data writes leaves `step_00000003/writer-<token>/` beside the re-save's, which
    commits. gc never reported it (under a milestone it stayed forever). Now the dry run
    lists it, --delete removes it, and the committed checkpoint still verifies and loads."""
    from storage_servers import new_bucket, s3_options
    proxy = request.getfixturevalue("condition_ignoring_proxy")
    root = Root(f"s3://{new_bucket(request.getfixturevalue('s3_admin'))}/run",
                s3_options(proxy.endpoint))
    run = root.manager(model_of(1))
    run.save(3)
    run.close()
    backend = root.backend()
    kept = data_file(root, 3)
    assert "/writer-" in kept
    # What the killed save left: its own writer directory, with its data files.
    orphan = "step_00000003/writer-0123456789abcdef0123456789abcdef"
    backend.write_bytes(f"{orphan}/model/__0_0.distcp", b"x" * 1000)
    backend.write_bytes(f"{orphan}/model/.metadata", b"y" * 10)

    listed = statereg.engine.gc.collect_garbage(backend, grace_s=0)
    assert [(f.kind, f.path, f.size, f.action) for f in listed] == [
        ("orphan writer directory", orphan, 1010, "delete")]
    young = statereg.engine.gc.collect_garbage(backend, grace_s=3600)
    assert young[0].action.startswith("keep: younger than the grace period")
    done = statereg.engine.gc.collect_garbage(backend, delete=True, grace_s=0)
    assert [(f.path, f.action) for f in done] == [(orphan, "deleted")]
    assert not [f for f in backend.walk("step_00000003") if f.path.startswith(orphan)]
    statereg.verify(f"{root.url}/step_00000003", root.options)
    assert root.manager(model_of(2)).load().step == 3
    assert statereg.engine.gc.collect_garbage(backend, grace_s=0) == []


def test_a_damaged_base_whose_readers_it_broke_is_retired_and_they_after_it(tmp_path):
    """Step 3 (incremental) references every file of step 2; step 2's data file is
    truncated, which damages both. The resume takes step 1; save(2) retires step 2 (step 3
    cannot load anyway: its files there fail its own records, so it keeps nothing), and
    save(3) retires step 3 in turn."""
    root = Root(str(tmp_path / "root"), {})
    first = root.manager(model_of(1))
    first.save(1)
    first.close()
    same = model_of(2)
    run = root.manager(same, incremental=True)
    run.save(2)
    run.save(3)
    run.close()
    assert any(r.path.startswith("step_00000002/") for r in statereg.read_manifest(
        f"{root.url}/step_00000003").references)
    truncate(root, 2)

    again = root.manager(model_of(9), incremental=True)
    assert again.load().step == 1
    again.save(2)
    again.save(3)
    again.save(4)
    assert [u.rsplit("/", 1)[1] for u in again.list()] == [
        f"step_{n:08d}" for n in (1, 2, 3, 4)]
    for n in (2, 3, 4):
        statereg.verify(f"{root.url}/step_{n:08d}")


def test_links_and_fifos_under_a_checkpoints_name_are_named_by_gc_and_skipped(tmp_path,
                                                                             capsys):
    root = Root(str(tmp_path / "root"), {})
    run = root.manager(model_of(1))
    run.save(1)
    run.close()
    os.symlink(str(tmp_path / "root" / "step_00000001"), str(tmp_path / "root" / "step_00000002"))
    os.mkfifo(str(tmp_path / "root" / "step_00000003"))
    os.symlink("/nowhere", str(tmp_path / "root" / "step_00000004"))

    again = root.manager(model_of(2))
    assert again.load().step == 1
    again.save(5)
    assert [u.rsplit("/", 1)[1] for u in again.list()] == ["step_00000001", "step_00000005"]
    assert statereg.cli.main(["gc", root.url, "--delete", "--grace", "0"]) == 0
    printed = capsys.readouterr().out
    for name, kind in (("step_00000002", "symlink"), ("step_00000003", "fifo"),
                       ("step_00000004", "symlink")):
        assert f"{name}  unreadable entry" in printed and f"keep: a {kind}" in printed
        assert os.path.lexists(tmp_path / "root" / name)


# JSON that `json.loads(bytes)` would take for UTF-16/32 (it guesses from the NUL bytes) and
# decode with a codec imported on first use: as another user the interpreter's library
# folder may be unreadable (seed 8011: "LookupError: unknown encoding: utf-16-be" from a
# claim holding such garbage). statereg writes UTF-8 and reads it as UTF-8 (RFC 8259).
_WIDE = ["utf-16-be", "utf-16-le", "utf-32-be", "utf-32-le"]


def _parsed_wide_files() -> list[str]:
    from statereg.engine.claims import ClaimInfo
    from statereg.formats.jsonstate import decode_state
    from statereg.schemas.manifest import parse_manifest
    claim = ('{"token": "t", "host": "h", "host_id": "i", "pid": 1, "thread": "x", '
             '"started_at": 0, "renewed_at": 0, "lease_s": 60}')
    seen = []
    for codec in _WIDE:
        data = claim.encode(codec)
        seen.append(f"claim {codec}: {ClaimInfo.parse(data)}")
        for parse in (parse_manifest, decode_state):
            try:
                parse(data, "where")
            except statereg.StateregError as exc:
                seen.append(f"{type(exc).__name__}")
    return seen


def test_json_files_in_another_encoding_are_damage_never_an_odd_error():
    assert _parsed_wide_files() == [
        item for codec in _WIDE
        for item in (f"claim {codec}: None", "ManifestError", "CorruptCheckpointError")]


@needs_root
def test_json_files_in_another_encoding_are_damage_as_another_user():
    assert as_other_user(_parsed_wide_files) == _parsed_wide_files()
