"""Crash drills for memory-first tiers (docs/tiers.md): a real trainer process is SIGKILLed
during a memory save or during a drain; a restart must resume bit-identically from the
newest complete copy in either tier, and storage.url must never hold a partial checkpoint.

Run as a script, this file is the trainer: `python test_tier_drills.py DURABLE POINT` trains
12 steps (memory every 2, drain every 4) and kills itself with SIGKILL when it reaches
POINT, after writing POINT to DURABLE/../reached (proof it got there).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import statereg
from statereg.backends.local import LocalBackend
from statereg.backends.registry import open_backend
from statereg.backends.shm import SharedMemoryBackend
from statereg.engine.checkpoints import list_committed
from statereg.engine.verify import verify_files

STEPS = 12
# Where the trainer dies: (tier, checkpoint, what), see `arm`.
POINTS = {
    "memory_mid_save": ("memory", "step_00000006", "second_file"),
    "memory_before_manifest": ("memory", "step_00000006", "manifest"),
    "drain_mid_copy": ("durable", "step_00000004", "second_file"),
    "drain_before_manifest": ("durable", "step_00000008", "manifest"),
}


def spec(durable: str) -> dict[str, Any]:
    return {"storage": {"url": durable},
            "components": {"model": {"kind": "model"}, "optimizer": {"kind": "optimizer"}},
            "tiers": {"memory": {"every": 2, "keep_last": 2},
                      "durable": {"every": 4, "keep_last": 2}}}


class Trainee:
    """A tiny model and AdamW whose state after step s is the same bits in every process."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                         torch.nn.Linear(16, 4))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.01)

    def step(self, step: int) -> None:
        data = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        self.model(data).square().mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def manager(self, durable: str) -> statereg.CheckpointManager:
        return statereg.CheckpointManager(spec(durable), model=self.model,
                                          optimizer=self.optimizer)

    def tensors(self) -> dict[str, torch.Tensor]:
        found = {f"model.{k}": v.clone() for k, v in self.model.state_dict().items()}
        for index, state in self.optimizer.state_dict()["state"].items():
            found.update({f"opt.{index}.{k}": torch.as_tensor(v).clone()
                          for k, v in state.items()})
        return found


def arm(point: str, marker: Path) -> None:
    """Make this process SIGKILL itself when a save reaches `point` (no cleanup runs)."""
    tier, victim, what = POINTS[point]
    opened: list[str] = []

    def ours(backend: Any, path: str) -> bool:
        is_memory = isinstance(backend, SharedMemoryBackend)
        return path.startswith(f"{victim}/") and is_memory == (tier == "memory")

    def die() -> None:
        marker.write_text(point)
        os.kill(os.getpid(), signal.SIGKILL)

    open_write, create_bytes = LocalBackend.open_write, LocalBackend.create_bytes

    def armed_open_write(self: Any, path: str, on_done: Any = None) -> Any:
        if ours(self, path) and what == "second_file":
            opened.append(path)
            if len(opened) == 2:
                die()
        return open_write(self, path, on_done)

    def armed_create_bytes(self: Any, path: str, data: bytes) -> Any:
        if ours(self, path) and what == "manifest" and path.endswith("/manifest.json"):
            die()
        return create_bytes(self, path, data)

    LocalBackend.open_write = armed_open_write  # type: ignore[method-assign]
    LocalBackend.create_bytes = armed_create_bytes  # type: ignore[method-assign]


def train(durable: str, point: str) -> None:
    arm(point, Path(durable).parent / "reached")
    trainee = Trainee()
    mgr = trainee.manager(durable)
    for step in range(1, STEPS + 1):
        trainee.step(step)
        mgr.save(step)
    mgr.close()


def trained(steps: int) -> dict[str, torch.Tensor]:
    trainee = Trainee()
    for step in range(1, steps + 1):
        trainee.step(step)
    return trainee.tensors()


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """A private folder on the real tmpfs (/dev/shm) where there is one, else on disk."""
    if os.access("/dev/shm", os.W_OK):
        shm = Path(tempfile.mkdtemp(prefix="statereg-drill-", dir="/dev/shm"))
    else:
        shm = tmp_path / "shm"
        shm.mkdir()
    values = {"STATEREG_SHM_DIR": str(shm), "STATEREG_NODE": "node0",
              "STATEREG_RUN_ID": "drill"}
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    yield values
    shutil.rmtree(shm, ignore_errors=True)


def committed_steps(backend: Any) -> list[int]:
    return [c.step for c in list_committed(backend)]


def assert_no_partial_checkpoint(durable: str) -> None:
    """Every checkpoint storage.url shows is whole: every file, every checksum."""
    backend = open_backend(durable)
    for committed in list_committed(backend):
        verify_files(backend, committed.name, committed.manifest.files, "full")


def test_sigkill_during_memory_saves_and_drains_resumes_bit_identically(
        tmp_path: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    # Every point gets its own run (own durable root and run id), all killed in parallel.
    runs = {}
    for point in POINTS:
        root = tmp_path / point
        root.mkdir()
        child_env = {**os.environ, **env, "STATEREG_RUN_ID": point}
        runs[point] = (root, subprocess.Popen(
            [sys.executable, __file__, str(root / "durable"), point], env=child_env,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    for point, (root, process) in runs.items():
        _, err = process.communicate(timeout=120)
        assert process.returncode == -signal.SIGKILL, (point, err.decode()[-2000:])
        assert (root / "reached").read_text() == point

        monkeypatch.setenv("STATEREG_RUN_ID", point)
        durable = str(root / "durable")
        assert_no_partial_checkpoint(durable)
        fresh = Trainee()
        mgr = fresh.manager(durable)
        newest = max(committed_steps(mgr._tiers.memory) + committed_steps(mgr._backend))
        result = mgr.load()
        assert result is not None and result.step == newest, point
        assert result.path.startswith("shm://"), point  # memory held the newest copy
        expected = trained(newest)
        got = fresh.tensors()
        assert expected.keys() == got.keys()
        assert all(torch.equal(expected[k], got[k]) for k in expected), point
        # The run goes on from there: later saves and drains commit over the leftovers.
        for step in range(newest + 1, STEPS + 1):
            fresh.step(step)
            mgr.save(step)
        mgr.close()
        assert committed_steps(mgr._backend)[-1] == 12
        assert_no_partial_checkpoint(durable)
        assert torch.equal(fresh.tensors()["model.0.weight"], trained(STEPS)["model.0.weight"])


def test_restart_after_the_node_lost_its_memory_restores_from_durable(
        tmp_path: Path, env: dict[str, str]) -> None:
    root = tmp_path / "reboot"
    root.mkdir()
    process = subprocess.run(
        [sys.executable, __file__, str(root / "durable"), "drain_before_manifest"],
        env={**os.environ, **env}, capture_output=True, timeout=120)
    assert process.returncode == -signal.SIGKILL, process.stderr.decode()[-2000:]
    durable = str(root / "durable")
    # The drain of step 8 died before its manifest; the wait policy had finished step 4's.
    assert committed_steps(open_backend(durable)) == [4]
    for entry in Path(env["STATEREG_SHM_DIR"]).iterdir():  # a reboot empties tmpfs
        shutil.rmtree(entry)
    fresh = Trainee()
    mgr = fresh.manager(durable)
    result = mgr.load()
    assert result.step == 4 and result.path == f"{durable}/step_00000004"
    got, expected = fresh.tensors(), trained(4)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    mgr.close()


def test_a_job_with_another_run_id_never_loads_the_first_jobs_memory(
        tmp_path: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    durable = str(tmp_path / "durable")
    first = Trainee()
    mgr = first.manager(durable)
    for step in (1, 2):
        first.step(step)
        mgr.save(step)
    mgr.close()
    assert committed_steps(open_backend(durable)) == []  # step 2 is in memory only
    monkeypatch.setenv("STATEREG_RUN_ID", "another-job")
    second = Trainee()
    assert second.manager(durable).load() is None
    untouched = Trainee().tensors()
    assert all(torch.equal(t, untouched[k]) for k, t in second.tensors().items())


if __name__ == "__main__":
    train(sys.argv[1], sys.argv[2])
