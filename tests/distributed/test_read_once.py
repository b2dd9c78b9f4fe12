"""A load reads each stored byte once per job (issue 17), counted on the real S3 server.

Every rank talks to the S3 server through a relay port of its own (tests/s3_request_log.py),
which logs each request and the body bytes it returned, so the test sees per rank what
was asked of the store. For a `replicated` model and a `global` optimizer loaded at 4 ranks:
each data file is fetched by exactly one rank (then broadcast), the manifest, the listing
and every `.metadata` by rank 0 only, and the bytes the job reads are the checkpoint's data
bytes plus under 1% of metadata. A damaged item still fails the load on every rank with
CorruptCheckpointError, and a resume falls back on every rank alike. For an FSDP model saved
at 4 ranks and loaded at 2, each rank reads the items it needs, not whole files.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import run_ranks
from s3_request_log import Request, RequestLog, mark
from storage_servers import new_bucket, s3_options
from torch import nn
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import statereg
from statereg.dcp.metadata import load_dcp_metadata
from statereg.errors import CorruptCheckpointError, StateregError

RANKS = 4


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 512), nn.Linear(512, 256))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(3)  # the same batches on every rank, as under DDP
    for _ in range(steps):
        model(torch.randn(4, 256, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _trained(steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _net(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, opt, steps)
    return model, opt


def _tensors(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    state = {f"w.{k}": v for k, v in model.state_dict().items()}
    for index, entries in enumerate(opt.state.values()):
        state.update({f"o.{index}.{k}": v for k, v in entries.items()})
    return state


def _assert_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def _spec(url: str, options: dict[str, Any]) -> dict:
    return {"storage": {"url": url, "options": options},
            "components": {"model": {"kind": "model", "sharing": "replicated"},
                           "optimizer": {"kind": "optimizer", "sharing": "global"}}}


def _save_two_steps(url: str, options: dict) -> None:
    """Steps 1 and 2, from this process: one copy of each, as a job of any size writes it;
    four files per component, so each of the 4 loading ranks can own some."""
    model, opt = _trained(steps=1)
    spec = _spec(url, options)
    spec["storage"]["io_threads"] = RANKS
    with statereg.CheckpointManager(spec, model=model, optimizer=opt) as mgr:
        mgr.save(step=1)
        _train(model, opt, 1)
        mgr.save(step=2)


def load_counted(rank: int, world: int, url: str, per_rank: list[dict], damaged: str,
                 sharded_url: str, direct: dict, reference: str) -> None:
    """The counted loads at 4 ranks; then, in the same run, the sharded save at 4 ranks."""
    options = per_rank[rank]
    endpoint = options["client_kwargs"]["endpoint_url"]
    model = _net(seed=rank + 7)  # another init on each rank: the load must overwrite it
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    want = _tensors(*_trained(steps=1))
    with statereg.CheckpointManager(_spec(url, options), model=model, optimizer=opt) as mgr:
        mark(endpoint, "load")
        assert mgr.load(step=1).step == 1
        mark(endpoint, "loaded")
        _assert_identical(_tensors(model, opt), want)

        # One rank reads the damaged file; every rank fails with CorruptCheckpointError
        # naming it, and the live state the load reached is marked unusable on every rank.
        with pytest.raises(CorruptCheckpointError) as info:
            mgr.load(step=2)
        assert damaged in str(info.value), str(info.value)
        with pytest.raises(StateregError, match=r"save\(step=3\) refused: loading .* failed"):
            mgr.save(step=3)
        # A resume falls back to the intact step 1 on every rank alike.
        assert mgr.load().step == 1
        _assert_identical(_tensors(model, opt), want)
    save_sharded(rank, world, sharded_url, direct, reference)


def _object_sizes(s3_admin: Any, root: str) -> dict[str, int]:
    s3_admin.invalidate_cache()
    return {path.removeprefix(f"{root}/"): info["size"]
            for path, info in s3_admin.find(root, detail=True).items()}


def _data_reads(requests: list[Request], root: str) -> dict[str, list[Request]]:
    """Object GETs of `.distcp` files, by path under the root."""
    found: dict[str, list[Request]] = {}
    for request in requests:
        if request.is_object_read and request.path.endswith(".distcp"):
            found.setdefault(request.path.removeprefix(f"/{root}/"), []).append(request)
    return found


@dataclass
class FourRankRun:
    """One run of 4 ranks for both tests: the counted loads, then the sharded save."""

    root: str
    data: dict[str, int]  # step 1's data files (path under the root -> bytes)
    logs: list[list[Request]]  # each rank's requests during its load of step 1
    baseline: list[Request]  # the same load's requests in one process
    sharded_root: str
    reference: str  # the sharded model's full tensors, saved by rank 0
    log: RequestLog


@pytest.fixture(scope="module")
def four_ranks(s3_server: Any, s3_admin: Any,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[FourRankRun]:
    tmp = tmp_path_factory.mktemp("read-once")
    direct = s3_options(s3_server.endpoint)
    log = RequestLog(s3_server.endpoint, RANKS + 1)  # the last port: a one-process baseline
    root, sharded_root = f"{new_bucket(s3_admin)}/run", f"{new_bucket(s3_admin)}/run"
    url = f"s3://{root}"
    _save_two_steps(url, direct)
    sizes = _object_sizes(s3_admin, root)
    data = {p: n for p, n in sizes.items() if p.startswith("step_00000001/")
            and p.endswith(".distcp")}
    # Damage one model item of step 2 in the middle of its tensor bytes (size unchanged).
    damaged = max((p for p in sizes if p.startswith("step_00000002/model/")
                   and p.endswith(".distcp")), key=sizes.get)
    blob = bytearray(s3_admin.cat_file(f"{root}/{damaged}"))
    blob[len(blob) // 2] ^= 0x40
    s3_admin.pipe_file(f"{root}/{damaged}", bytes(blob))

    # One process, the same load: what the job must not exceed however many ranks it has.
    endpoints = log.endpoints
    model = _net(seed=9)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    spec = _spec(url, s3_options(endpoints[RANKS]))
    with statereg.CheckpointManager(spec, model=model, optimizer=opt) as mgr:
        mark(endpoints[RANKS], "load")
        mgr.load(step=1)
        mark(endpoints[RANKS], "loaded")

    reference = str(tmp / "sharded-reference.pt")
    per_rank = [s3_options(endpoint) for endpoint in endpoints[:RANKS]]
    run_ranks(RANKS, load_counted, tmp, url, per_rank, damaged.split("/", 1)[1],
              f"s3://{sharded_root}", direct, reference)
    yield FourRankRun(root, data, [log.logs[r].between("load", "loaded") for r in range(RANKS)],
                      log.logs[RANKS].between("load", "loaded"), sharded_root, reference, log)
    log.close()


def test_replicated_and_global_loads_read_each_data_file_once_at_4_ranks(
        four_ranks: FourRankRun) -> None:
    run = four_ranks
    assert {p.split("/")[1] for p in run.data} == {"model", "optimizer"}
    reads = [_data_reads(requests, run.root) for requests in run.logs]
    alone = _data_reads(run.baseline, run.root)
    for path, size in run.data.items():
        readers = [r for r in range(RANKS) if path in reads[r]]
        assert len(readers) == 1, f"{path} was read by ranks {readers}"
        # Fetched as a one-process load fetches it: requests per file do not grow with ranks.
        assert len(reads[readers[0]][path]) == len(alone[path]), path
        assert sum(r.body_bytes for r in reads[readers[0]][path]) == size, path
    assert all(len(r) > 0 for r in reads), "every rank reads a share of the files"
    # Manifest, manifest.sum, the listing, .metadata and the sidecar: rank 0 alone.
    for rank in range(1, RANKS):
        others = [r for r in run.logs[rank]
                  if not (r.is_object_read and r.path.endswith(".distcp"))]
        assert others == [], f"rank {rank} read {others}"
    unique = sum(run.data.values())
    total = sum(r.body_bytes for requests in run.logs for r in requests)
    assert unique <= total <= unique * 1.01, (total, unique)
    assert sum(len(requests) for requests in run.logs) == len(run.baseline)


# -- sharded, 4 -> 2 ----------------------------------------------------------------------


def _sharded_net(seed: int) -> nn.Module:
    """Rows that split evenly at 4 and 2 ranks (1024) and rows that do not (10), so a rank
    at 2 needs some items of a file written at 4 and not others."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 1024), nn.Linear(1024, 10))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def _sharded_spec(url: str, options: dict[str, Any]) -> dict:
    # One data file per rank: a rank at 2 ranks then needs part of some files.
    return {"storage": {"url": url, "options": options, "io_threads": 1},
            "components": {"model": {"kind": "model"}}}


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone()
            for k, v in model.state_dict().items()}


def save_sharded(rank: int, world: int, url: str, options: dict, reference: str) -> None:
    model = _sharded_net(seed=0)
    with statereg.CheckpointManager(_sharded_spec(url, options), model=model) as mgr:
        mgr.save(step=1)
    full = _full(model)
    if rank == 0:
        torch.save(full, reference)


def load_sharded(rank: int, world: int, url: str, per_rank: list[dict], reference: str,
                 metadata: bytes, needed_out: str) -> None:
    options = per_rank[rank]
    endpoint = options["client_kwargs"]["endpoint_url"]
    model = _sharded_net(seed=rank + 5)
    mgr = statereg.CheckpointManager(_sharded_spec(url, options), model=model)
    mark(endpoint, "load")
    mgr.load(step=1)
    mark(endpoint, "loaded")
    _assert_identical(_full(model), torch.load(reference))
    # The items this rank needs, as DCP plans them for its shards.
    stored = load_dcp_metadata(metadata, "model/.metadata")
    plan = create_default_local_load_plan(model.state_dict(), stored)
    needed = sum(stored.storage_data[index].length
                 for index in {item.storage_index for item in plan.items})
    Path(f"{needed_out}.{rank}").write_text(json.dumps(needed))
    mgr.close()


def test_sharded_load_4_to_2_reads_the_items_each_rank_needs(
        four_ranks: FourRankRun, s3_admin: Any, tmp_path: Path) -> None:
    run = four_ranks
    metadata = s3_admin.cat_file(f"{run.sharded_root}/step_00000001/model/.metadata")
    files = {p: n for p, n in _object_sizes(s3_admin, run.sharded_root).items()
             if p.endswith(".distcp")}
    # Two more relay ports' worth: ranks 0 and 1 of this run use fresh logs.
    log = RequestLog(run.log.upstream, 2)
    try:
        per_rank = [s3_options(endpoint) for endpoint in log.endpoints]
        needed_out = str(tmp_path / "needed")
        run_ranks(2, load_sharded, tmp_path, f"s3://{run.sharded_root}", per_rank,
                  run.reference, metadata, needed_out)
        logs = [log.logs[r].between("load", "loaded") for r in range(2)]
    finally:
        log.close()
    for rank in range(2):
        needed = json.loads(Path(f"{needed_out}.{rank}").read_text())
        reads = _data_reads(logs[rank], run.sharded_root)
        read = sum(r.body_bytes for requests in reads.values() for r in requests)
        whole = sum(files[p] for p in reads)
        # Only the needed items move (a little framing aside), not the whole files.
        assert needed <= read <= needed * 1.02 + 1024, (rank, needed, read, whole)


# -- a consolidated torch file ------------------------------------------------------------


def _torch_file_spec(root: str) -> dict:
    return {"storage": {"url": root},
            "components": {"model": {"kind": "model", "sharing": "replicated",
                                     "format": "torch"}}}


def load_torch_file(rank: int, world: int, root: str, out: str) -> None:
    """Load the consolidated model, recording every whole-file read this rank makes."""
    from statereg.backends.local import LocalBackend

    read: list[str] = []
    real = LocalBackend.read_bytes

    def counted(self: LocalBackend, path: str, limit: int | None = None) -> bytes:
        read.append(path)
        return real(self, path, limit)

    LocalBackend.read_bytes = counted  # type: ignore[method-assign]
    model = _net(seed=rank + 3)
    statereg.CheckpointManager(_torch_file_spec(root), model=model).load()
    _assert_identical({k: v for k, v in model.state_dict().items()},
                      {k: v for k, v in _trained(steps=1)[0].state_dict().items()})
    Path(out, f"reads-{rank}.json").write_text(json.dumps(read))


def test_a_consolidated_torch_file_is_read_by_one_rank_and_broadcast(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    model, _ = _trained(steps=1)
    statereg.CheckpointManager(_torch_file_spec(root), model=model).save(step=1)
    run_ranks(2, load_torch_file, tmp_path, root, str(tmp_path))
    reads = [json.loads((tmp_path / f"reads-{r}.json").read_text()) for r in range(2)]
    assert reads[0].count("step_00000001/model/model.pt") == 1, reads[0]
    assert "step_00000001/model/model.pt" not in reads[1], reads[1]
