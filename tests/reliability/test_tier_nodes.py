"""Two nodes that are really two networks (issue 27 case 7): rank 1 runs in a network
namespace of its own, joined to rank 0's by a veth pair, as two hosts on one link are; gloo
runs over the veth ($GLOO_SOCKET_IFNAME), as torchrun on two nodes does.

- A peer address that only reaches its own machine (a loopback address: here
  $STATEREG_PEER_HOST=127.0.0.1; on clusters, a host name that resolves to 127.0.1.1) is
  refused at construction on both ranks, naming $STATEREG_PEER_HOST and $GLOO_SOCKET_IFNAME:
  before, the job trained on and every replica and drain failed later, one log line each.
- Without $STATEREG_PEER_HOST, each node serves on the address of the interface gloo uses,
  and a job with a replica saves, replicates across the veth and closes cleanly.

Needs root (network namespaces), as CI runs the reliability tests; skipped otherwise.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# This user's folder of memory roots under the shared-memory folder (backends/shm.py).
PRIVATE = f"statereg-{os.geteuid()}"

RANK = r"""
import os, sys
import torch, torch.distributed as dist
import statereg
rank, init, durable = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
torch.manual_seed(0)
model = torch.nn.Linear(4, 4)
optimizer = torch.optim.AdamW(model.parameters())
spec = {"storage": {"url": durable},
        "components": {"model": {"kind": "model", "sharing": "replicated"},
                       "optimizer": {"kind": "optimizer", "sharing": "replicated"}},
        "tiers": {"memory": {"every": 1, "keep_last": 2, "replicate": {"to": "next_node"}},
                  "durable": {"every": 2}}}
try:
    mgr = statereg.CheckpointManager(spec, model=model, optimizer=optimizer)
except statereg.StateregError as exc:
    print(f"REFUSED {type(exc).__name__}: {exc}", flush=True)
    sys.exit(3)
with mgr:
    for step in (1, 2):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        mgr.save(step)
print("SAVED", flush=True)
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def two_networks() -> Iterator[tuple[str, str, str]]:
    """A network namespace joined to this one by a veth pair: (namespace, this side's
    interface, its side's interface)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    tag = f"{os.getpid() % 100000}"
    space, here, there = f"srt{tag}", f"srta{tag}", f"srtb{tag}"
    subnet = f"10.231.{random.randrange(1, 250)}"
    try:
        _ip("netns", "add", space)
        _ip("link", "add", here, "type", "veth", "peer", "name", there)
        _ip("link", "set", there, "netns", space)
        _ip("addr", "add", f"{subnet}.1/24", "dev", here)
        _ip("link", "set", here, "up")
        _ip("-n", space, "addr", "add", f"{subnet}.2/24", "dev", there)
        _ip("-n", space, "link", "set", there, "up")
        _ip("-n", space, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as exc:
        subprocess.run(["ip", "netns", "del", space], capture_output=True)
        pytest.skip(f"cannot make a network namespace here: {exc.stderr.decode().strip()}")
    try:
        yield space, here, there
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True)
        subprocess.run(["ip", "netns", "del", space], capture_output=True)


def _job(tmp: Path, networks: tuple[str, str, str], extra: dict[str, str],
         ) -> list[subprocess.CompletedProcess[str]]:
    space, here, there = networks
    init, durable = tmp / "pg-init", tmp / "durable"
    init.unlink(missing_ok=True)
    (tmp / "shm").mkdir(exist_ok=True)
    procs = []
    for rank, interface in enumerate((here, there)):
        path = f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
        env = {**os.environ, "PYTHONPATH": path,
               "STATEREG_SHM_DIR": str(tmp / "shm"), "STATEREG_NODE": f"node{rank}",
               "STATEREG_RUN_ID": "two-networks", "GLOO_SOCKET_IFNAME": interface, **extra}
        if "STATEREG_PEER_HOST" not in extra:
            env.pop("STATEREG_PEER_HOST", None)
        command = [sys.executable, "-c", RANK, str(rank), str(init), str(durable)]
        if rank == 1:
            command = ["ip", "netns", "exec", space, *command]
        procs.append(subprocess.Popen(command, env=env, cwd=REPO, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


def test_a_loopback_peer_address_across_two_networks_is_refused_at_construction(
        tmp_path: Path, two_networks: tuple[str, str, str]) -> None:
    ranks = _job(tmp_path, two_networks, {"STATEREG_PEER_HOST": "127.0.0.1"})
    for rank, done in enumerate(ranks):
        assert done.returncode == 3, (rank, done.stdout, done.stderr[-3000:])
        assert "REFUSED StorageError: memory tier: node 0 (rank 0) would serve its memory " \
               "to the other nodes at 127.0.0.1 (from $STATEREG_PEER_HOST), a loopback " \
               "address, which reaches only the machine it is on" in done.stdout, done.stdout
        assert "Set $STATEREG_PEER_HOST on each node" in done.stdout
        assert "$GLOO_SOCKET_IFNAME" in done.stdout
    assert not list((tmp_path / "shm").rglob("step_*"))  # refused before any save


def test_two_networks_serve_on_the_gloo_interface_and_replicate_across_it(
        tmp_path: Path, two_networks: tuple[str, str, str]) -> None:
    ranks = _job(tmp_path, two_networks, {})
    for rank, done in enumerate(ranks):
        assert done.returncode == 0 and "SAVED" in done.stdout, (rank, done.stderr[-3000:])
        assert "replicating" not in done.stderr, done.stderr[-3000:]
    # Node 1 holds node 0's files of step 2 (its replica), copied over the veth.
    node1 = tmp_path / "shm" / PRIVATE / "node1" / "two-networks"
    assert any(node1.rglob("step_00000002/model/*")), sorted(map(str, node1.rglob("*")))
    assert (tmp_path / "durable" / "step_00000002" / "manifest.json").exists()
