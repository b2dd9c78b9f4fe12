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

import logging
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

import statereg
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
    if request.param == "memory":
        from conftest import make_store
        return Root(make_store("memory", request, tmp_path).url, {})
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
