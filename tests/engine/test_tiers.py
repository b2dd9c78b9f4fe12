"""Memory-first tiers (docs/tiers.md): the declaration, the shm:// backend, which tier each
save goes to, draining, retention per tier, and restoring from the nearest complete copy."""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tier_trainee import Trainee
from unwritable import unwritable

import statereg
from statereg.backends.registry import open_backend
from statereg.backends.shm import SharedMemoryBackend
from statereg.engine.checkpoints import list_committed, read_manifest_at
from statereg.engine.io_policy import io_policy
from statereg.engine.verify import verify_files
from statereg.engine.world import World, WorldLayout
from statereg.errors import CorruptCheckpointError, SpecError, StateregError, StorageError
from statereg.tiers.identity import Nodes, identity_folder, job_identity, run_id
from tests.conftest import make_store

COMPONENTS = {"model": {"kind": "model"}, "optimizer": {"kind": "optimizer"}}
# This user's folder of memory roots under the shared-memory folder (backends/shm.py).
PRIVATE = f"statereg-{os.geteuid()}"


@pytest.fixture(autouse=True)
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private shared-memory folder (on the real tmpfs where there is one) and node name."""
    if os.access("/dev/shm", os.W_OK):
        folder = Path(tempfile.mkdtemp(prefix="statereg-test-", dir="/dev/shm"))
    else:
        folder = tmp_path / "shm"
        folder.mkdir()
    monkeypatch.setenv("STATEREG_SHM_DIR", str(folder))
    monkeypatch.setenv("STATEREG_NODE", "node0")
    monkeypatch.setenv("STATEREG_RUN_ID", "run7")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def tiered(url: str, memory: dict[str, Any] | None = None,
           durable: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return {"storage": {"url": url}, "components": COMPONENTS,
            "tiers": {"memory": {"every": 2, **(memory or {})},
                      "durable": {"every": 4, **(durable or {})}}, **extra}


def trained(steps: int) -> Trainee:
    trainee = Trainee()
    for step in range(1, steps + 1):
        trainee.step(step)
    return trainee


def assert_same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def run(spec: dict[str, Any], steps: int) -> statereg.CheckpointManager:
    trainee = Trainee()
    mgr = trainee.manager(spec)
    for step in range(1, steps + 1):
        trainee.step(step)
        mgr.save(step)
    mgr.wait()
    return mgr


def flip_middle_byte(path: Path, mask: int) -> None:
    """Damage a file in the middle of its bytes, its size unchanged."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= mask
    path.write_bytes(bytes(data))


def steps_in(url: str) -> list[int]:
    return [c.step for c in list_committed(open_backend(url))]


# -- the declaration ----------------------------------------------------------------------


def test_without_tiers_every_save_goes_to_storage_url_and_nothing_touches_shm(
        tmp_path: Path, shm: Path) -> None:
    spec = {"storage": {"url": str(tmp_path / "ckpt")}, "components": COMPONENTS}
    assert statereg.load_spec(spec).tiers is None
    mgr = run(spec, 3)
    assert mgr.list() == [f"{tmp_path}/ckpt/step_0000000{s}" for s in (1, 2, 3)]
    assert not os.listdir(shm)


@pytest.mark.parametrize(("tiers", "message"), [
    ({"memory": {"keep_last": 1}},
     "tiers.memory.keep_last: keep_last 1 is below 2: with one memory checkpoint, a crash "
     "while it is being replaced leaves no complete copy in memory; use 2 or more"),
    ({"memory": {"every": 3}, "durable": {"every": 10}},
     "tiers: durable.every 10 is not a multiple of memory.every 3"),
    ({"memory": {"replicate": {"to": "any_node"}}},
     "tiers.memory.replicate.to: Input should be 'next_node'"),
    ({"memory": {"url": "/dev/shm/x"}}, "memory tier url '/dev/shm/x' must be shm://NAME"),
    ({"memory": {"drain": "later"}}, "tiers.memory.drain: Input should be 'wait' or 'skip'"),
])
def test_bad_tier_declarations_are_refused_naming_the_field(
        tiers: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as raised:
        statereg.load_spec({"storage": {"url": "/x"}, "components": COMPONENTS,
                            "tiers": tiers})
    assert message in str(raised.value)


@pytest.mark.parametrize(("save", "message"), [
    ({"keep_last": 3}, "move save.keep_last / keep_every to tiers.durable"),
    ({"incremental": True}, "'tiers' with save.incremental is not built yet"),
])
def test_save_settings_that_tiers_replace_are_refused(save: dict[str, Any],
                                                      message: str) -> None:
    with pytest.raises(SpecError) as raised:
        statereg.load_spec(tiered("/x", save=save))
    assert message in str(raised.value)


# -- the shm:// backend -------------------------------------------------------------------


def test_shm_url_is_a_folder_per_node_under_the_shared_memory_dir(
        shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = open_backend("shm://run7/job")
    assert isinstance(backend, SharedMemoryBackend)
    assert backend.root == f"{shm}/{PRIVATE}/node0/run7/job"
    monkeypatch.setenv("STATEREG_NODE", "node1")
    assert open_backend("shm://run7/job").root == f"{shm}/{PRIVATE}/node1/run7/job"
    with pytest.raises(SpecError, match=r"'shm://run7/\.\./x': write shm://NAME"):
        open_backend("shm://run7/../x")


def test_shm_refuses_a_tmpfs_too_small_with_the_numbers(tmp_path: Path) -> None:
    spec = tiered(str(tmp_path / "durable"), memory={"keep_last": 10**9})
    with pytest.raises(StorageError) as raised:
        Trainee().manager(spec)
    text = str(raised.value)
    assert "is too small for tiers.memory.keep_last 1000000000 checkpoints" in text
    assert "bytes are free plus 0 held by this job's memory checkpoints" in text
    assert "Lower tiers.memory.keep_last" in text
    assert "other jobs" not in text


def test_shm_refusal_names_the_memory_other_jobs_left_on_the_node(
        tmp_path: Path, shm: Path) -> None:
    """Memory checkpoints outlive their job by design; when they crowd out a new job, the
    refusal says which folders hold how much, biggest first, this job's own excepted."""
    mine = shm / PRIVATE
    left = {mine / "node0/run6/ws1-aaaa": 3000, mine / "node0/run5/ws2-bbbb": 7000,
            mine / "node1/run4/ws1-cccc": 9000}  # another node's folder: not listed
    for folder, size in left.items():
        folder.mkdir(parents=True)
        (folder / "f.distcp").write_bytes(b"x" * size)
    spec = tiered(str(tmp_path / "durable"), memory={"keep_last": 10**9})
    with pytest.raises(StorageError) as raised:
        Trainee().manager(spec)
    text = str(raised.value)
    assert (f"other jobs' memory checkpoints on this node hold 10,000 bytes (memory outlives a "
            f"job by design; delete the folders of finished jobs to free it: "
            f"{mine}/node0/run5/ws2-bbbb 7,000, {mine}/node0/run6/ws1-aaaa 3,000)"
            ) in text


def test_shm_recycling_writes_over_a_retired_file_and_cuts_it_to_its_new_size() -> None:
    backend = open_backend("shm://run7/recycle")
    assert isinstance(backend, SharedMemoryBackend)
    backend.recycle = True
    backend.write_bytes("step_00000001/model/__0_0.distcp", b"old bytes " * 100)
    old = os.stat(backend.full_path("step_00000001/model/__0_0.distcp")).st_ino
    backend.remove_tree("step_00000001")
    assert backend.list_dir("") == [".recycled"]  # gone from every listing of steps
    with backend.open_write("step_00000002/model/__0_0.distcp") as stream:
        stream.write(b"new")
    assert backend.read_bytes("step_00000002/model/__0_0.distcp") == b"new"
    assert os.stat(backend.full_path("step_00000002/model/__0_0.distcp")).st_ino == old
    with backend.open_write("step_00000002/model/other") as stream:  # no retired file
        stream.write(b"fresh")
    assert backend.read_bytes("step_00000002/model/other") == b"fresh"
    backend.remove_tree("step_00000002")  # replaces the checkpoint retired before it
    assert [f.path for f in backend.walk(".recycled")] == [
        ".recycled/step_00000002/model/__0_0.distcp", ".recycled/step_00000002/model/other"]
    backend.drop_recycled()
    assert backend.list_dir("") == []


@pytest.mark.parametrize(("cpus", "local_ranks", "writers"), [
    (2, None, 2), (16, None, 8), (16, "4", 4), (16, "16", 2), (64, "2", 8), (16, "x", 8)])
def test_memory_writers_share_the_cores_among_the_nodes_ranks(monkeypatch, cpus, local_ranks,
                                                              writers) -> None:
    # A memory save is CPU work: the writers per rank follow the cores this process may use
    # and torchrun's LOCAL_WORLD_SIZE (a value that is not a count reads as one rank).
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    if local_ranks is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_ranks)
    memory = io_policy(open_backend("shm://run7/writers").capabilities)
    assert memory.write_threads == memory.read_threads == writers
    disk = io_policy(open_backend(str(tempfile.gettempdir())).capabilities)
    assert disk.write_threads == 2  # disk: unchanged


MIB = 1 << 20


def pattern(size: int, seed: int) -> bytes:
    return torch.randint(0, 256, (size,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed)).numpy().tobytes()


def test_shm_writes_over_a_recycled_file_through_a_mapping_kept_while_its_size_holds() -> None:
    backend = open_backend("shm://run7/mapped")
    assert isinstance(backend, SharedMemoryBackend)
    backend.recycle = True
    kept = backend._mappings._by_inode
    name = "model/__0_0.distcp"

    def save(step: int, data: bytes, pieces: int = 3) -> int:
        path = f"step_{step:08d}/{name}"
        with backend.open_write(path) as stream:
            cut = len(data) // pieces
            for at in range(0, len(data), cut):  # pieces of any size, small ones too
                stream.write(data[at:at + cut])
            stream.write(b"")
        assert backend.read_bytes(path) == data
        assert backend.size(path) == len(data)
        backend.remove_tree(f"step_{step:08d}")  # retired: the next save writes over it
        return os.stat(backend.full_path(f".recycled/step_{step:08d}/{name}")).st_ino

    inode = save(1, pattern(2 * MIB, 1))
    assert not kept  # a new file: written through its descriptor
    assert save(2, pattern(2 * MIB, 2)) == inode
    [mapping] = kept.values()
    assert save(3, pattern(2 * MIB, 3)) == inode
    assert list(kept.values()) == [mapping]  # the same mapping, its page tables kept
    assert save(4, pattern(MIB + 5, 4), pieces=7) == inode  # shorter: cut, mapping dropped
    assert not kept
    assert save(5, pattern(3 * MIB + 1, 5)) == inode  # longer: the rest by pwrite
    assert not kept  # grew: mapped again at its new size next time
    assert save(6, pattern(3 * MIB + 1, 6)) == inode and len(kept) == 1
    backend.drop_recycled()  # the file is deleted: its mapping must not keep its pages
    assert not kept


def with_a_retired_file() -> SharedMemoryBackend:
    """A recycling memory root whose retired step 1 holds a 2 MiB file, for step 2 to take."""
    backend = open_backend("shm://run7/mapped")
    assert isinstance(backend, SharedMemoryBackend)
    backend.recycle = True
    backend.write_bytes("step_00000001/model/__0_0.distcp", pattern(2 * MIB, 1))
    backend.remove_tree("step_00000001")
    return backend


def test_a_file_that_cannot_be_mapped_is_written_through_its_descriptor(
        monkeypatch: pytest.MonkeyPatch) -> None:
    backend = with_a_retired_file()

    def no_room(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr("statereg.backends.mappings.mmap.mmap", no_room)
    data = pattern(2 * MIB, 2)
    with backend.open_write("step_00000002/model/__0_0.distcp") as stream:
        stream.write(data)
    assert backend.read_bytes("step_00000002/model/__0_0.distcp") == data
    assert len(backend._mappings) == 0


def test_a_failed_write_through_a_mapping_drops_it_and_reports_nothing() -> None:
    backend = with_a_retired_file()
    reported = []
    stream = backend.open_write("step_00000002/model/__0_0.distcp", reported.append)
    assert len(backend._mappings) == 1
    stream.write(pattern(MIB, 2))
    stream.abort()  # what BackendFileSystem does when the writer raised
    assert reported == [] and len(backend._mappings) == 0
    backend.release_mappings()


def central_crcs(data: bytes) -> list[int]:
    """The CRC-32 of every central directory entry in a file of torch.save records."""
    found, at = [], data.find(b"PK\x01\x02")
    while at >= 0:
        found.append(int.from_bytes(data[at + 16:at + 20], "little"))
        at = data.find(b"PK\x01\x02", at + 4)
    return found


def saved_in_memory_twice(trainee: Trainee, mgr: statereg.CheckpointManager,
                          ) -> tuple[SharedMemoryBackend, list[str]]:
    """Steps 1 and 2 trained and saved (each waited for): the memory root, and the data files
    of step 2 there."""
    for step in (1, 2):
        trainee.step(step)
        mgr.save(step)
        mgr.wait()
    memory = mgr._tiers.memory
    return memory, [f.path for f in memory.walk("step_00000002") if f.path.endswith(".distcp")]


def assert_restores_step_2(durable: Path, trainee: Trainee) -> None:
    """A fresh trainee loads step 2 from `durable` alone, bit for bit `trainee`'s state."""
    restored = Trainee(seed=1)
    with restored.manager({"storage": {"url": str(durable)}, "components": COMPONENTS}) as plain:
        assert plain.load().step == 2
    assert_same_bits(restored.tensors(), trainee.tensors())


@pytest.mark.parametrize("drain", ["drain", "statereg cp"])
def test_memory_records_have_no_crcs_and_their_durable_copies_get_them(
        tmp_path: Path, drain: str, record_code: bool) -> None:
    """In memory, tensor records skip the zip CRC-32s (a pass over every byte that nothing
    checks); a copy to a store that keeps them (the drain, `statereg cp`) adds them: each
    record is then torch.save's bytes, passes zip checks, and plain DCP loads the copy.
    Under $STATEREG_PLAIN_TORCH_SAVE=1 (`record_code` True) torch.save writes the memory
    records, CRC-32s and all, and torch.load and torch.save copy them: the same copies."""
    import pickle
    import zipfile

    import torch.distributed.checkpoint as dcp

    from statereg.engine.transfer import copy_checkpoint

    trainee = Trainee()
    durable = tmp_path / "durable"
    with trainee.manager(tiered(str(durable), memory={"every": 1},
                                durable={"every": 2 if drain == "drain" else 1000})) as mgr:
        memory, files = saved_in_memory_twice(trainee, mgr)
        in_memory = [central_crcs(memory.read_bytes(path)) for path in files]
        if drain != "drain":
            copy_checkpoint(memory, "step_00000002", open_backend(str(durable)))
    assert files and all(crcs and (set(crcs) == {0}) != record_code for crcs in in_memory)
    copied = open_backend(str(durable))
    [committed] = list_committed(copied)
    verify_files(copied, committed.name, committed.manifest.files, "full")
    paths = [f.path for f in committed.manifest.files]
    assert sorted(paths) == sorted(set(paths)) == sorted(
        f.path for f in read_manifest_at(memory, "step_00000002").files)
    for component in ("model", "optimizer"):
        folder = durable / "step_00000002" / component
        metadata = pickle.loads((folder / ".metadata").read_bytes())
        for info in metadata.storage_data.values():
            data = (folder / info.relative_path).read_bytes()
            record = data[info.offset:info.offset + info.length]
            if record[:4] != b"PK\x03\x04":
                continue  # a pickled object, not a tensor record
            assert zipfile.ZipFile(io.BytesIO(record)).testzip() is None
            tensor = torch.load(io.BytesIO(record), weights_only=True)
            expected = io.BytesIO()
            torch.save(tensor, expected)
            assert record == expected.getvalue()  # torch.save's bytes, CRC-32s and all
    expected = trainee.model.state_dict()
    loaded = {name: torch.zeros_like(value) for name, value in expected.items()}
    dcp.load(loaded, checkpoint_id=str(durable / "step_00000002" / "model"))  # torch's reader
    assert all(torch.equal(loaded[name].view(torch.uint8), value.view(torch.uint8))
               for name, value in expected.items())
    assert_restores_step_2(durable, trainee)


def test_compressed_memory_records_keep_their_crcs_and_drain_as_they_are(
        tmp_path: Path) -> None:
    """Compressed items would have to be decoded to get CRC-32s added, so a memory save
    with compression writes them (inside its frames) and the drain copies the files."""
    trainee = Trainee()
    durable = tmp_path / "durable"
    spec = tiered(str(durable), memory={"every": 1}, durable={"every": 2})
    spec["storage"]["compression"] = "zstd"
    with trainee.manager(spec) as mgr:
        memory, files = saved_in_memory_twice(trainee, mgr)
        in_memory = {path: memory.read_bytes(path) for path in files}
    assert files and all((durable / path).read_bytes() == data
                         for path, data in in_memory.items())
    assert_restores_step_2(durable, trainee)


@pytest.mark.parametrize("where", ["payload", "central directory"])
def test_a_damaged_memory_record_is_never_copied_with_fresh_crcs(tmp_path: Path,
                                                                  where: str) -> None:
    """Adding CRC-32s rewrites a record's bytes, so the copy checks the memory bytes against
    their digests first: a flipped byte is refused, never laundered into a valid record."""
    from statereg.engine.transfer import copy_checkpoint

    trainee = Trainee(width=64, hidden=64)
    with trainee.manager(tiered(str(tmp_path / "durable"), memory={"every": 1},
                                durable={"every": 1000})) as mgr:
        trainee.step(1)
        mgr.save(1)
        mgr.wait()
        memory = mgr._tiers.memory
        path = next(f.path for f in memory.walk("step_00000001") if f.path.endswith(".distcp"))
        full = Path(memory.full_path(path))
        data = bytearray(full.read_bytes())
        at = (data.index(b"PK\x01\x02") + 16 if where == "central directory"
              else data.index(b"archive/data/0") + 200)
        data[at] ^= 0x10
        full.write_bytes(bytes(data))
        target = open_backend(str(tmp_path / "copy"))
        with pytest.raises(CorruptCheckpointError, match="does not match its digest") as raised:
            copy_checkpoint(memory, "step_00000001", target)
        assert memory.display(path) in str(raised.value)
        assert list_committed(target) == []


def test_memory_saves_reuse_retired_checkpoints_files_and_stay_verified(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("statereg.backends.mappings.MAP_AT_LEAST", 1)  # map these small files
    trainee = Trainee()
    mgr = trainee.manager(tiered(str(tmp_path / "durable"), memory={"every": 1},
                                 durable={"every": 1000}))
    memory = mgr._tiers.memory
    inodes = {}
    for step in range(1, 6):
        trainee.step(step)
        mgr.save(step)
        mgr.wait()
        inodes[step] = {f.path.split("/", 1)[1]: os.stat(memory.full_path(f.path)).st_ino
                        for f in memory.walk(f"step_{step:08d}")
                        if f.path.endswith(".distcp")}
    assert inodes[4] == inodes[1] and inodes[5] == inodes[2]  # step 1's pages hold step 4
    assert steps_in(memory.url) == [4, 5]
    # Written through mappings kept by inode: at most keep_last + 1 checkpoints' files.
    assert 0 < len(memory._mappings) <= 3 * len(inodes[5])
    for committed in list_committed(memory):
        verify_files(memory, committed.name, committed.manifest.files, "full")
    expected = trainee.tensors()
    mgr.close()
    assert ".recycled" not in memory.list_dir("")  # close frees the retired pages
    assert len(memory._mappings) == 0  # and the mappings that would hold them
    restored = Trainee()
    with restored.manager(tiered(str(tmp_path / "durable"), memory={"every": 1})) as again:
        assert again.load().step == 5
    assert_same_bits(restored.tensors(), expected)


# -- saving -------------------------------------------------------------------------------


def test_save_picks_the_due_tiers_and_retention_runs_per_tier(tmp_path: Path) -> None:
    durable = str(tmp_path / "durable")
    trainee = Trainee()
    mgr = trainee.manager(tiered(durable, durable={"keep_last": 2}))
    handles = []
    for step in range(1, 14):
        trainee.step(step)
        handles.append(mgr.save(step))
        mgr.wait()
    memory = mgr._tiers.memory
    assert not handles[0].due and not handles[2].due and handles[0] == ""
    with pytest.raises(statereg.StateregError, match=r"save\(step=1\) saved nothing: no tier"):
        handles[0].info()
    assert handles[1] == memory.display("step_00000002")
    assert steps_in(memory.url) == [10, 12]  # keep_last 2 (the default)
    assert steps_in(durable) == [8, 12]  # drained 4, 8, 12; keep_last 2
    for committed in list_committed(open_backend(durable)):
        verify_files(open_backend(durable), committed.name, committed.manifest.files, "full")
    mgr.close()


class BlockedWrites:
    """Holds every file write into the durable root until `release()` (a slow store)."""

    def __init__(self, backend: Any) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        original = backend.open_write

        def open_write(path: str, on_done: Any = None) -> Any:
            self.entered.set()
            assert self.gate.wait(30)
            return original(path, on_done)

        backend.open_write = open_write

    def release(self) -> None:
        self.gate.set()


def test_drain_skip_policy_drops_a_due_drain_while_one_is_in_flight(tmp_path: Path) -> None:
    durable = str(tmp_path / "durable")
    trainee = Trainee()
    mgr = trainee.manager(tiered(durable, memory={"drain": "skip", "keep_last": 2},
                                 durable={"every": 2}))
    blocked = BlockedWrites(mgr._backend)
    trainee.step(1), trainee.step(2)
    mgr.save(2)
    assert blocked.entered.wait(10)
    for step in (3, 4, 5, 6):
        trainee.step(step)
        mgr.save(step)
    # The drain of step 2 still reads it: memory retention keeps it next to 4 and 6.
    assert steps_in(mgr._tiers.memory.url) == [2, 4, 6]
    blocked.release()
    mgr.wait()
    assert steps_in(durable) == [2]
    trainee.step(7), trainee.step(8)
    mgr.save(8)
    mgr.wait()
    assert steps_in(durable) == [2, 8]
    assert steps_in(mgr._tiers.memory.url) == [6, 8]
    mgr.close()


def test_a_failed_drain_is_logged_raised_by_wait_and_the_next_due_step_drains_again(
        tmp_path: Path, caplog: Any) -> None:
    """The durable root refuses writes for one drain (a real refusal: see unwritable.py):
    the failure is logged at once, the next wait() raises it saying memory holds the
    checkpoint, memory keeps it loadable, the durable root shows nothing of it, and the next
    due step drains normally."""
    durable = tmp_path / "durable"
    trainee = Trainee()
    mgr = trainee.manager(tiered(str(durable), durable={"every": 2}))
    trainee.step(1), trainee.step(2)
    mgr.save(2)
    mgr.wait()
    assert steps_in(str(durable)) == [2]
    trainee.step(3), trainee.step(4)
    with unwritable(durable), caplog.at_level(logging.ERROR, logger="statereg"):
        mgr.save(4)
        with pytest.raises(StateregError) as failed:
            mgr.wait()
    assert "draining shm://" in caplog.text and "step_00000004" in caplog.text
    assert f"a drain to {durable} failed" in str(failed.value)
    assert "the memory tier holds the checkpoint, the next due step drains again" in str(
        failed.value)
    assert steps_in(str(durable)) == [2]
    assert not (durable / "step_00000004").exists()
    memory = mgr._tiers.memory
    assert steps_in_backend(memory) == [2, 4]
    step_4 = list_committed(memory)[-1]
    verify_files(memory, step_4.name, step_4.manifest.files, "full")  # intact, every byte
    trainee.step(5), trainee.step(6)
    mgr.save(6)
    mgr.wait()
    mgr.close()
    assert steps_in(str(durable)) == [2, 6]
    restored = Trainee(seed=1)
    with restored.manager(tiered(str(durable), durable={"every": 2})) as again:
        assert again.load(step=6) is not None  # the drained copy, from the durable root
    assert_same_bits(restored.tensors(), trainee.tensors())


def test_a_failed_drain_is_raised_by_the_next_save_and_saving_again_goes_on(
        tmp_path: Path) -> None:
    """A loop that never calls wait() still hears of a failed drain (issue 27 case 7): the
    next save() raises it, before saving, saying memory holds the checkpoints; the same
    step saved again goes on, and its drain commits once the durable root takes writes."""
    durable = tmp_path / "durable"
    trainee = Trainee()
    mgr = trainee.manager(tiered(str(durable), durable={"every": 2}))
    trainee.step(1), trainee.step(2)
    mgr.save(2)
    mgr.wait()
    trainee.step(3), trainee.step(4)
    with unwritable(durable):
        mgr.save(4)  # its drain fails on the background thread
        trainee.step(5), trainee.step(6)
        with pytest.raises(StateregError) as failed:
            mgr.save(6)
    assert str(failed.value).startswith(f"save(step=6): a drain to {durable} failed: ")
    assert str(failed.value).endswith("The memory tier holds its checkpoints; this step was "
                                      "not saved: save it again to go on")
    assert steps_in_backend(mgr._tiers.memory) == [2, 4]  # 6 was not saved
    mgr.save(6)
    mgr.close()
    assert steps_in(str(durable)) == [2, 6]


def test_a_durable_tier_that_misses_max_missed_drains_stops_the_run_unless_told_to_carry_on(
        tmp_path: Path, caplog: Any) -> None:
    """drain: skip with a drain that never ends: no failure to raise, yet storage.url holds
    nothing new; the due drain after max_missed uncommitted ones stops the run."""
    for on_missed in ("stop", "carry_on"):
        durable = str(tmp_path / on_missed)
        trainee = Trainee()
        mgr = trainee.manager(tiered(durable, memory={"drain": "skip"},
                                     durable={"every": 2, "max_missed": 2,
                                              "on_missed": on_missed}))
        blocked = BlockedWrites(mgr._backend)
        try:
            for step in (2, 4):  # 2 drains (hung), 4 skipped
                trainee.step(step - 1), trainee.step(step)
                mgr.save(step)
            assert blocked.entered.wait(10)
            trainee.step(5), trainee.step(6)
            if on_missed == "stop":
                with pytest.raises(StateregError, match=rf"save\(step=6\): {durable} has not "
                                   r"committed a checkpoint for 2 due drains \(steps 2, 4; the "
                                   r"last committed drain: none in this run\).* The run stops "
                                   r"here \(tiers.durable.max_missed 2\)"):
                    mgr.save(6)
            else:
                with caplog.at_level(logging.ERROR, logger="statereg"):
                    mgr.save(6)
                assert "has not committed a checkpoint for 2 due drains" in caplog.text
        finally:
            blocked.release()
            mgr.close()


def test_drain_wait_policy_blocks_the_next_due_drain_until_the_first_commits(
        tmp_path: Path) -> None:
    durable = str(tmp_path / "durable")
    trainee = Trainee()
    mgr = trainee.manager(tiered(durable, durable={"every": 2}))
    blocked = BlockedWrites(mgr._backend)
    trainee.step(1), trainee.step(2)
    mgr.save(2)
    assert blocked.entered.wait(10)
    threading.Timer(0.3, blocked.release).start()
    trainee.step(3), trainee.step(4)
    mgr.save(4)  # waits for the drain of step 2 first
    assert steps_in(durable) == [2]
    mgr.wait()
    assert steps_in(durable) == [2, 4]
    mgr.close()


def test_durable_on_the_s3_server(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    store = make_store("s3", request, tmp_path)
    spec = tiered(store.url)
    spec["storage"]["options"] = store.options
    mgr = run(spec, 9)
    mgr.close()
    assert steps_in_backend(open_backend(store.url, store.options)) == [4, 8]
    fresh = Trainee()
    restorer = fresh.manager(spec)
    assert restorer.load().step == 8
    assert_same_bits(fresh.tensors(), trained(8).tensors())
    restorer.close()


def steps_in_backend(backend: Any) -> list[int]:
    return [c.step for c in list_committed(backend)]


# -- restoring ----------------------------------------------------------------------------


class CountedReads:
    """Counts the bytes and calls read from a backend (every read goes through these)."""

    def __init__(self, backend: Any) -> None:
        self.bytes = self.calls = 0
        read_bytes, open_read = backend.read_bytes, backend.open_read

        def counted_read_bytes(path: str, limit: int | None = None) -> bytes:
            data = read_bytes(path, limit)
            self.calls += 1
            self.bytes += len(data)
            return data

        def counted_open_read(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return open_read(*args, **kwargs)

        backend.read_bytes, backend.open_read = counted_read_bytes, counted_open_read


def test_load_restores_from_memory_reading_zero_bytes_from_durable(tmp_path: Path) -> None:
    spec = tiered(str(tmp_path / "durable"))
    run(spec, 11).close()
    fresh = Trainee()
    mgr = fresh.manager(spec)
    reads = CountedReads(mgr._backend)
    result = mgr.load()
    assert (result.step, reads.calls, reads.bytes) == (10, 0, 0)
    assert result.path == mgr._tiers.memory.display("step_00000010")
    assert_same_bits(fresh.tensors(), trained(10).tensors())
    mgr.close()


def test_load_takes_the_durable_tier_when_it_holds_a_newer_step(tmp_path: Path,
                                                               caplog: Any) -> None:
    spec = tiered(str(tmp_path / "durable"))
    mgr = run(spec, 9)
    memory_root = mgr._tiers.memory.root
    mgr.close()
    os.remove(f"{memory_root}/step_00000008/manifest.json")  # memory now ends at step 6
    fresh = Trainee()
    with caplog.at_level(logging.INFO, logger="statereg"):
        result = fresh.manager(spec).load()
    assert result.step == 8 and result.path == f"{tmp_path}/durable/step_00000008"
    assert "memory tier: step 6 is older than step 8" in caplog.text
    assert_same_bits(fresh.tensors(), trained(8).tensors())


def test_a_damaged_memory_copy_fails_closed_to_the_durable_tier(tmp_path: Path,
                                                                caplog: Any) -> None:
    spec = tiered(str(tmp_path / "durable"))
    mgr = run(spec, 9)
    memory_root = mgr._tiers.memory.root
    mgr.close()
    flip_middle_byte(next(Path(memory_root, "step_00000008", "model").glob("*.distcp")), 0x10)
    fresh = Trainee()
    with caplog.at_level(logging.WARNING, logger="statereg"):
        result = fresh.manager(spec).load()
    assert result.path == f"{tmp_path}/durable/step_00000008"
    assert "memory copy shm://run7/" in caplog.text and "unusable" in caplog.text
    assert_same_bits(fresh.tensors(), trained(8).tensors())


def test_a_memory_copy_whose_reads_fail_falls_back_to_the_durable_tier(
        tmp_path: Path, caplog: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # What a peer node that stalls or lies mid-read gives (tiers/transport.py): a
    # StorageError naming it, not damage. The memory copy is a cache: the load goes on to
    # the next copy, here storage.url, instead of failing the resume.
    spec = tiered(str(tmp_path / "durable"))
    mgr = run(spec, 9)
    mgr.close()

    def stalling(read: Any) -> Any:
        def stalled(self: Any, path: str, *args: Any, **kwargs: Any) -> Any:
            if path.startswith("step_00000008/model/"):
                raise StorageError("the peer node at 10.0.0.2:4242 sent nothing for 60 s")
            return read(self, path, *args, **kwargs)
        return stalled

    for name in ("open_read", "open_ranges", "open_blocks", "read_bytes"):
        monkeypatch.setattr(SharedMemoryBackend, name,
                            stalling(getattr(SharedMemoryBackend, name)))

    fresh = Trainee()
    with caplog.at_level(logging.WARNING, logger="statereg"):
        result = fresh.manager(spec).load()
    assert result.path == f"{tmp_path}/durable/step_00000008"
    assert "unusable" in caplog.text and "10.0.0.2:4242" in caplog.text
    assert_same_bits(fresh.tensors(), trained(8).tensors())


def test_one_ladder_walks_damaged_memory_then_damaged_durable_copies_to_the_newest_intact(
        tmp_path: Path, caplog: Any) -> None:
    # Memory holds steps 8 and 10, storage.url steps 4 and 8; all but storage.url's step 4
    # are damaged. One resume walks them newest first across both tiers (engine/resume.py)
    # and says, one line per copy skipped, why and which copy it resumes from next.
    durable = tmp_path / "durable"
    spec = tiered(str(durable))
    mgr = run(spec, 11)
    memory_root = mgr._tiers.memory.root
    mgr.close()
    for folder in (Path(memory_root, "step_00000010"), Path(memory_root, "step_00000008"),
                   durable / "step_00000008"):
        flip_middle_byte(next((folder / "model").glob("*.distcp")), 0x10)
    fresh = Trainee()
    with caplog.at_level(logging.WARNING, logger="statereg"):
        result = fresh.manager(spec).load()

    assert result.step == 4 and result.path == f"{durable}/step_00000004"
    assert_same_bits(fresh.tensors(), trained(4).tensors())
    skips = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(skips) == 3, skips
    memory = "shm://run7/" + Path(memory_root).name
    walked = [(m.split(" ", 3)[2] if m.startswith("memory copy") else m.split(" ", 1)[0],
               m.split("; resuming from ", 1)[1].split(" ", 1)[0]) for m in skips]
    assert walked == [(f"{memory}/step_00000010", f"{memory}/step_00000008"),
                      (f"{memory}/step_00000008", f"{durable}/step_00000008"),
                      (f"{durable}/step_00000008", f"{durable}/step_00000004")]
    assert "unusable (" in skips[0] and "unusable (" in skips[1]
    assert "is damaged (" in skips[2] and "save of step 8 re-verifies it" in skips[2]


def test_a_damaged_newest_memory_copy_falls_back_to_the_older_one_and_is_replaced(
        tmp_path: Path, caplog: Any) -> None:
    spec = tiered(str(tmp_path / "durable"), durable={"every": 100})  # memory only
    mgr = run(spec, 11)  # memory holds steps 8 and 10
    memory_root = mgr._tiers.memory.root
    mgr.close()
    flip_middle_byte(next(Path(memory_root, "step_00000010", "optimizer").glob("*.distcp")), 0x01)
    resumed = Trainee()
    mgr = resumed.manager(spec)
    with caplog.at_level(logging.WARNING, logger="statereg"):
        result = mgr.load()
    assert result.step == 8 and result.path.startswith("shm://run7/")
    assert "step_00000010 unusable" in caplog.text
    assert_same_bits(resumed.tensors(), trained(8).tensors())
    # The run goes on from step 8: its step 10 replaces the damaged one of the run it left.
    for step in (9, 10):
        resumed.step(step)
        mgr.save(step)
    mgr.close()
    assert "removing shm://run7/" in caplog.text
    fresh = Trainee()
    assert fresh.manager(spec).load().step == 10
    assert_same_bits(fresh.tensors(), trained(10).tensors())


@pytest.mark.parametrize("early_return", [False, True])
def test_async_memory_saves_commit_share_retain_and_drain_in_the_background(
        tmp_path: Path, early_return: bool) -> None:
    spec = tiered(str(tmp_path / "durable"),
                  save={"async": "thread", "early_return": early_return})
    trainee = Trainee()
    mgr = trainee.manager(spec)
    for step in range(1, 13):
        trainee.step(step)
        handle = mgr.save(step)
        if handle is not None and early_return:
            handle.wait_staged()  # before the next step changes the state
    mgr.wait()
    memory = open_backend(mgr._tiers.memory.url)
    assert [c.step for c in list_committed(memory)] == [10, 12]  # keep_last 2
    assert steps_in(str(tmp_path / "durable")) == [4, 8, 12]
    mgr.close()
    fresh = Trainee()
    result = fresh.manager(spec).load()
    assert result.step == 12 and result.path.startswith("shm://run7/")
    assert_same_bits(fresh.tensors(), trained(12).tensors())


def test_a_missing_memory_file_skips_that_step_with_one_line(tmp_path: Path,
                                                             caplog: Any) -> None:
    spec = tiered(str(tmp_path / "durable"))
    mgr = run(spec, 11)
    memory_root = mgr._tiers.memory.root
    mgr.close()
    shutil.rmtree(f"{memory_root}/step_00000010/optimizer")
    fresh = Trainee()
    with caplog.at_level(logging.WARNING, logger="statereg"):
        result = fresh.manager(spec).load()
    assert result.step == 8 and result.path.startswith("shm://run7/")  # older memory copy
    assert "step_00000010 skipped: 4 file(s) missing or of the wrong size" in caplog.text
    assert_same_bits(fresh.tensors(), trained(8).tensors())


def test_identity_binds_memory_to_run_world_and_topology() -> None:
    spec = statereg.load_spec(tiered("/durable"))
    pair = World(0, 2, layout=WorldLayout(0, 2, {}))
    one = job_identity(spec, World(), Nodes.from_names(["node0"]))
    two = job_identity(spec, pair, Nodes.from_names(["node0", "node0"]))
    split = job_identity(spec, pair, Nodes.from_names(["node0", "node1"]))
    assert one["run_id"] == run_id(spec) == "run7"
    assert identity_folder(one).startswith("ws1-") and identity_folder(two).startswith("ws2-")
    assert len({identity_folder(one), identity_folder(two), identity_folder(split)}) == 3
    assert identity_folder(one) == identity_folder(
        job_identity(spec, World(), Nodes.from_names(["node0"])))
    # A replaced host keeps its place: the same ranks on a node of another name are the
    # same job, so its ranks restore from the peer's replica.
    assert identity_folder(split) == identity_folder(
        job_identity(spec, pair, Nodes.from_names(["node0", "spare7"])))


def test_another_identity_in_the_same_run_is_never_loaded(tmp_path: Path, caplog: Any) -> None:
    spec = tiered(str(tmp_path / "durable"))
    mgr = run(spec, 3)  # memory only: steps 2 (durable every 4)
    memory_root = Path(mgr._tiers.memory.root)
    mgr.close()
    # The same run id, as a job of another world size left it.
    memory_root.rename(memory_root.with_name("ws2-0123456789abcdef"))
    with caplog.at_level(logging.WARNING, logger="statereg"):
        assert Trainee().manager(spec).load() is None
    assert "holds only checkpoints of other job identities (ws2-0123456789abcdef" in caplog.text
    assert "which are never loaded" in caplog.text


HOLDER = """
import json, sys, time
sys.path.insert(0, sys.argv[2])
from tier_trainee import Trainee

trainee = Trainee()
mgr = trainee.manager(json.loads(sys.argv[1]))
for step in (1, 2):
    trainee.step(step)
    mgr.save(step)  # memory at step 2
print("saved", flush=True)
time.sleep(600)
"""


def test_a_second_live_job_on_the_same_memory_folder_is_refused_and_loses_nothing(
        tmp_path: Path) -> None:
    """Two jobs of one identity (same storage.url, run id and world size) would each take
    the other's memory checkpoints for an abandoned run's and replace them; the second is
    refused at construction with the holder's pid, until the holder dies (SIGKILL: the
    kernel drops its lock), and what the holder saved still loads bit for bit."""
    spec = tiered(str(tmp_path / "durable"), durable={"every": 1000})
    with subprocess.Popen(
            [sys.executable, "-c", HOLDER, json.dumps(spec), str(Path(__file__).parents[1])],
            stdout=subprocess.PIPE, text=True) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "saved\n"
            with pytest.raises(StorageError) as refused:
                trained(5).manager(spec)
            text = str(refused.value)
            assert "is in use by another live job on this node" in text
            assert f'"pid": {holder.pid}' in text
            assert "give this one its own storage.url" in text
        finally:
            holder.kill()
    restored = Trainee(seed=1)
    with restored.manager(spec) as mgr:  # the holder is gone: its lock went with it
        result = mgr.load()
    assert result is not None and result.step == 2 and result.path.startswith("shm://")
    assert_same_bits(restored.tensors(), trained(2).tensors())


def test_a_folder_without_record_locks_still_works_and_says_a_second_job_goes_unnoticed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """ENOLCK (a filesystem without POSIX record locks, e.g. some network mounts) cannot be
    produced on this machine's tmpfs, so the call is made to fail as it would there."""
    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr("statereg.tiers.lock.lockf", no_locks)
    with caplog.at_level(logging.WARNING, logger="statereg"):
        mgr = run(tiered(str(tmp_path / "durable")), 2)
    mgr.close()
    assert "memory tier: cannot lock" in caplog.text
    assert "a second job saving into this folder would not be detected" in caplog.text
    assert [c.step for c in list_committed(open_backend(mgr._tiers.memory.url))] == [2]


@pytest.fixture
def small_tmpfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A real 128 MiB tmpfs as the shared-memory folder, where this user may mount one."""
    folder = tmp_path / "small-tmpfs"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128M", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    monkeypatch.setenv("STATEREG_SHM_DIR", str(folder))
    yield folder
    if subprocess.run(["umount", str(folder)]).returncode != 0:
        subprocess.run(["umount", "--lazy", str(folder)], check=True)  # a file still open


def open_files_under(folder: Path) -> list[str]:
    """The files under `folder` this process holds open."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(f"{folder}/"):
            found.append(Path(target).name)
    return sorted(found)


@pytest.mark.parametrize("mode", ["off", "thread"])
def test_a_full_tmpfs_fails_the_memory_save_clearly_and_the_next_save_frees_its_files(
        tmp_path: Path, small_tmpfs: Path, caplog: Any, mode: str) -> None:
    """Another process fills the tmpfs between two saves: the memory save fails with what
    to do (not the generic 'check the credentials') and closes its files, the next memory
    save deletes them (retention sees committed checkpoints only, so they would hold RAM
    for the rest of the job), and a save once there is room again loads bit for bit."""
    trainee = Trainee(width=512, hidden=1024)  # ~6.3 MB with AdamW's moments
    spec = tiered(str(tmp_path / "durable"), durable={"every": 1000}, save={"async": mode})
    mgr = trainee.manager(spec)
    memory = mgr._tiers.memory
    for step in (1, 2):
        trainee.step(step)
        mgr.save(step)  # memory at 2
    hog = small_tmpfs / "hog"
    with hog.open("wb") as stream, pytest.raises(OSError):
        while True:
            stream.write(bytes(1 << 20))
    os.truncate(hog, hog.stat().st_size - (1 << 20))  # 1 MiB left: the save starts, then fails
    trainee.step(3)
    trainee.step(4)
    with pytest.raises(StorageError) as full:
        mgr.save(4)
        mgr.wait()  # an async save's failure comes here
    assert ("No space left on device. The filesystem (or your quota on it) is full"
            in str(full.value))
    assert any(memory.walk("step_00000004"))  # what it wrote before the tmpfs ran out
    # Its files are closed (the error still holds the frames that wrote them): an open
    # file would keep its tmpfs pages after it is deleted.
    assert open_files_under(small_tmpfs) == ["job.lock"]
    hog.unlink()
    for step in (5, 6):
        trainee.step(step)
        with caplog.at_level(logging.WARNING, logger="statereg"):
            mgr.save(step)  # memory at 6
    mgr.close()
    assert "removing" in caplog.text
    assert "step_00000004, left by its memory save, which failed" in caplog.text
    assert sorted(memory.list_dir("")) == sorted(
        ["identity.json", "job.lock", "latest", "step_00000002", "step_00000006"])
    restored = Trainee(width=512, hidden=1024, seed=1)
    with restored.manager(spec) as again:
        assert again.load().step == 6
    assert_same_bits(restored.tensors(), trainee.tensors())


def test_a_second_open_manager_in_the_same_process_is_refused_until_the_first_is_closed(
        tmp_path: Path) -> None:
    """Record locks do not conflict within a process, so the process keeps its own list:
    two open managers on one memory folder would replace each other's checkpoints as two
    jobs would. A manager closed, or dropped without close(), lets go of the folder."""
    spec = tiered(str(tmp_path / "durable"))
    first = Trainee().manager(spec)
    with pytest.raises(StorageError) as refused:
        Trainee().manager(spec)
    assert "is held by another open CheckpointManager in this process: close() it first" in str(
        refused.value)
    first.close()
    second = Trainee().manager(spec)
    del second  # dropped without close(): collected, and the folder with it
    Trainee().manager(spec).close()
