"""The crash-point matrix: a real save in a child process, SIGKILLed at each point.

After each kill, this process (not the one that died) checks that `mgr.load()` returns the
last complete checkpoint bit for bit, that `statereg ls` lists no partial checkpoint, that
`statereg gc` finds what the kill left and never a committed checkpoint, and that the next
save succeeds. On local disk and on the S3 server; the kill points are in crash_driver.py.
"""

from __future__ import annotations

import json
import uuid

import crash_driver
import pytest
from crash_driver import POINTS, SINGLE_COMPONENTS, Point, TinyState, declaration
from reliability_kit import KILLED, assert_identical, committed_names, forkserver, run_child

import statereg
from statereg.backends.registry import open_backend
from statereg.cli import main as cli
from statereg.engine.gc import collect_garbage

BACKENDS = ["local", "s3"]


def check_after_kill(store, point: Point, capsys, components=SINGLE_COMPONENTS) -> None:
    expected = point.loads
    listed = [f"step_{s:08d}" for s in point.listed]

    # A fresh manager loads the last complete checkpoint, bit for bit.
    fresh = TinyState.trained(7)  # different values everywhere
    mgr = statereg.CheckpointManager(declaration(store.url, store.options, components),
                                     **fresh.objects())
    result = mgr.load()
    if expected is None:
        assert result is None
    else:
        assert result.step == expected
        assert_identical(fresh.snapshot(), TinyState.trained(expected).snapshot())

    # `statereg ls` lists exactly the committed ones.
    assert cli(["ls", store.url, "--options", json.dumps(store.options)]) == 0
    out = capsys.readouterr().out
    shown = [line.split()[0] for line in out.splitlines()[1:] if line] if listed else []
    assert shown == listed, out

    # gc finds the leftovers, never a committed checkpoint, and removes them; every
    # committed checkpoint still verifies afterwards.
    backend = open_backend(store.url, store.options)
    found = collect_garbage(backend, delete=True, grace_s=0)
    assert not {f.path.split("/")[0] for f in found} & set(listed), found
    assert all(f.action == "deleted" for f in found), found
    assert committed_names(store.url, store.options) == listed
    for name in listed:
        statereg.verify(f"{store.url}/{name}", store.options)

    # The next save succeeds: the same step again if it was lost, else the next one.
    step = 3 if 2 in point.listed else (1 if expected is None else 2)
    nxt = TinyState.trained(step)
    statereg.CheckpointManager(declaration(store.url, store.options, components),
                               **nxt.objects()).save(step=step)
    again = TinyState.trained(7)
    reader = statereg.CheckpointManager(declaration(store.url, store.options, components),
                                        **again.objects())
    assert reader.load().step == step
    assert_identical(again.snapshot(), nxt.snapshot())


@pytest.mark.parametrize("store", BACKENDS, indirect=True)
@pytest.mark.parametrize("point", POINTS, ids=[p.name for p in POINTS])
def test_a_kill_at_each_point_keeps_the_last_complete_checkpoint(store, point, tmp_path,
                                                                  capsys):
    marker = tmp_path / f"reached-{uuid.uuid4().hex[:6]}"
    code = run_child(crash_driver.single, store.url, store.options, point.name, str(marker))

    assert code == KILLED, f"the child exited with {code}, not by SIGKILL"
    assert marker.read_text() == point.name  # it died where it was meant to
    check_after_kill(store, point, capsys)


@pytest.mark.parametrize("store", ["s3"], indirect=True)
def test_a_mid_file_kill_on_s3_leaves_an_incomplete_upload_that_gc_aborts(store, tmp_path):
    point = crash_driver.BY_NAME["mid_tensor_file"]
    code = run_child(crash_driver.single, store.url, store.options, point.name,
                     str(tmp_path / "reached"))
    assert code == KILLED

    backend = open_backend(store.url, store.options)
    uploads = backend.incomplete_uploads()
    assert uploads and {u.path.split("/")[0] for u in uploads} == {"step_00000002"}
    found = collect_garbage(backend, delete=True, grace_s=0)
    assert {(f.kind, f.action) for f in found} >= {("incomplete upload", "deleted")}
    assert backend.incomplete_uploads() == []
    assert committed_names(store.url, store.options) == ["step_00000001"]


@pytest.mark.parametrize("store", BACKENDS, indirect=True)
def test_killing_one_rank_of_a_two_rank_save_keeps_the_last_checkpoint(store, tmp_path,
                                                                       capsys):
    context = forkserver()
    marker = str(tmp_path / "reached")
    init_file = str(tmp_path / "pg-init")
    children = [context.Process(target=crash_driver.ranks,
                                args=(rank, 2, init_file, store.url, store.options, marker))
                for rank in range(2)]
    for child in children:
        child.start()
    children[1].join(120)
    assert children[1].exitcode == KILLED
    # As a launcher (torchrun) does when one rank dies: the job's other ranks go too.
    children[0].kill()
    children[0].join(30)
    assert children[0].exitcode == KILLED
    with open(marker) as f:
        assert f.read() == "rank1_mid_file"

    point = Point("rank1_mid_file", 1, (1,))
    check_after_kill(store, point, capsys, components=crash_driver.RANKS_COMPONENTS)
