"""The corruption sweep: flip one byte in, truncate, or delete every file of a checkpoint in
turn. `statereg verify` and every `load` (the default one included: bytes are checked as
they are read) raise CorruptCheckpointError naming the file and what differs; the live
objects are left as they were, or the manager refuses to save them until a load restores
them; a resume loads the last intact checkpoint instead. On local disk and on the S3 server."""

from __future__ import annotations

import json
import logging

import pytest
from crash_driver import SINGLE_COMPONENTS, TinyState, declaration
from reliability_kit import assert_identical

import statereg
from statereg.backends.registry import open_backend
from statereg.cli import main as cli
from statereg.engine.checkpoints import read_manifest_at

DAMAGES = ["flip", "truncate", "delete"]


def damage(store, path: str, how: str) -> bytes:
    """Damage the object at `path` under the root; returns its original bytes."""
    full = store.path(path)
    original = store.fs.cat_file(full)
    if how == "flip" and original:
        data = bytearray(original)
        data[len(data) // 2] ^= 0x01
        store.fs.pipe_file(full, bytes(data))
    elif how in ("flip", "truncate") and not original:  # an empty file: one byte appears
        store.fs.pipe_file(full, b"\x01")
    elif how == "truncate":
        store.fs.pipe_file(full, original[: len(original) // 2])
    else:
        store.fs.rm_file(full)
    store.fs.invalidate_cache()
    return original


def decl(store) -> dict:
    # Two writer threads: two data files per component on every backend, so the sweep is
    # small (it damages every file three ways), whatever the backend's default.
    spec = declaration(store.url, store.options, SINGLE_COMPONENTS)
    spec["storage"]["io_threads"] = 2
    return spec


def fresh_manager(store):
    state = TinyState.trained(9)
    return statereg.CheckpointManager(decl(store), **state.objects()), state


def unchanged_or_refused(mgr, state, untouched, label: str) -> str:
    """After a failed load: the live objects are exactly as they were, or the manager
    refuses to save them (tensors stream into live memory; docs/reliability.md)."""
    try:
        assert_identical(state.snapshot(), untouched, label)
        return "unchanged"
    except AssertionError:
        with pytest.raises(statereg.StateregError,
                           match=r"refused: loading .* failed .* a load that restores"):
            mgr.save(step=99)
        return "refused"


def expect_corrupt(call, *needles: str) -> str:
    with pytest.raises(statereg.CorruptCheckpointError) as info:
        call()
    message = str(info.value)
    for needle in needles:
        assert needle in message, message
    return message


@pytest.mark.parametrize("store", ["local", "s3"], indirect=True)
def test_every_damaged_file_is_named_and_nothing_is_modified(store, capsys, caplog):
    for step in (1, 2):
        statereg.CheckpointManager(decl(store), **TinyState.trained(step).objects()).save(
            step=step)
    url = f"{store.url}/step_00000002"
    manifest = statereg.read_manifest(url, store.options)
    records = {f.path: f for f in manifest.files}
    assert len(records) >= 8  # model and optimizer (.metadata, data files), json states
    options = ["--options", json.dumps(store.options)]
    mgr, state = fresh_manager(store)
    untouched = state.snapshot()
    swept = []

    for path, record in records.items():
        where = f"{url}/{path}"
        for how in DAMAGES:
            original = damage(store, f"step_00000002/{path}", how)
            what = {
                "flip": "differs from the manifest's",
                "truncate": f"has {record.size // 2} bytes, the manifest recorded {record.size}",
                "delete": f"is missing; the manifest lists it ({record.size} bytes)",
            }[how]
            if record.size == 0 and how != "delete":
                what = "has 1 bytes, the manifest recorded 0"
            expect_corrupt(lambda: statereg.verify(url, store.options), where, what)
            if not store.remote:  # the command prints the same message (once is enough)
                assert cli(["verify", url, *options]) == 1
                err = capsys.readouterr().err
                assert where in err and what in err, err
            expect_corrupt(lambda: mgr.load(url, verify="full"), where, what)
            assert_identical(state.snapshot(), untouched, f"{how} {path}")
            # The default load checks sizes first and every byte as it reads it.
            loaded, loaded_state = fresh_manager(store)
            expect_corrupt(lambda: loaded.load(url), where,  # noqa: B023 - called now
                           *([] if how == "flip" and record.size else [what]))
            unchanged_or_refused(loaded, loaded_state, untouched, f"{how} {path}")
            # A resume skips the damaged checkpoint for the last intact one, loudly.
            with caplog.at_level(logging.WARNING, logger="statereg"):
                assert loaded.load().step == 1
            assert "is damaged" in caplog.text and where in caplog.text, caplog.text
            caplog.clear()
            assert_identical(loaded_state.snapshot(), TinyState.trained(1).snapshot())
            loaded.save(step=3)  # the fallback load restored everything: saving works again
            store.fs.rm(store.path("step_00000003"), recursive=True)
            store.fs.invalidate_cache()
            store.fs.pipe_file(store.path(f"step_00000002/{path}"), original)
            swept.append((path, how))

    # The manifest itself: manifest.sum holds its checksum.
    for how in DAMAGES:
        mgr, state = fresh_manager(store)
        original = damage(store, "step_00000002/manifest.json", how)
        if how == "delete":  # no manifest: an uncommitted directory, as after a crash
            with pytest.raises(statereg.CheckpointNotFoundError, match="never committed"):
                mgr.load(url)
        else:
            expect_corrupt(lambda: statereg.verify(url, store.options),
                           f"{url}/manifest.json", "recorded in manifest.sum")
            expect_corrupt(lambda: mgr.load(url, verify="off"),  # noqa: B023 - called now
                           f"{url}/manifest.json")
        assert_identical(state.snapshot(), untouched, f"{how} manifest.json")
        # Resuming skips the damaged checkpoint and loads the last good one, loudly.
        with caplog.at_level(logging.WARNING, logger="statereg"):
            assert mgr.load().step == 1
        assert_identical(state.snapshot(), TinyState.trained(1).snapshot())
        assert how == "delete" or "skipping" in caplog.text
        caplog.clear()
        store.fs.pipe_file(store.path("step_00000002/manifest.json"), original)
        swept.append(("manifest.json", how))

    mgr, state = fresh_manager(store)
    for how in ("flip", "truncate"):
        original = damage(store, "step_00000002/manifest.sum", how)
        expect_corrupt(lambda: statereg.verify(url, store.options), "manifest")
        expect_corrupt(lambda: mgr.load(url), "manifest")
        assert_identical(state.snapshot(), untouched, f"{how} manifest.sum")
        store.fs.pipe_file(store.path("step_00000002/manifest.sum"), original)
        swept.append(("manifest.sum", how))
    # Without manifest.sum the manifest is read as one from before manifest checksums; the
    # checkpoint itself is intact, and every file is still checked against it.
    original = damage(store, "step_00000002/manifest.sum", "delete")
    statereg.verify(url, store.options)
    store.fs.pipe_file(store.path("step_00000002/manifest.sum"), original)

    assert len(swept) == 3 * len(records) + 5
    statereg.verify(url, store.options)
    assert mgr.load().step == 2
    assert_identical(state.snapshot(), TinyState.trained(2).snapshot())


def test_every_single_byte_flip_of_a_manifest_is_caught(tmp_path):
    """Not a sample: each byte of manifest.json flipped in turn (local disk: it is fast)."""
    url = statereg.CheckpointManager(declaration(str(tmp_path), {}, SINGLE_COMPONENTS),
                                     **TinyState.trained(1).objects()).save(step=1)
    path = tmp_path / "step_00000001" / "manifest.json"
    backend = open_backend(str(tmp_path))
    original = path.read_bytes()
    caught = 0
    for i in range(len(original)):
        data = bytearray(original)
        data[i] ^= 0x01
        path.write_bytes(bytes(data))
        with pytest.raises(statereg.CorruptCheckpointError, match=r"manifest\.sum"):
            read_manifest_at(backend, "step_00000001")
        caught += 1
    path.write_bytes(original)
    assert caught == len(original) > 1000
    statereg.verify(url)
