"""Which job a memory folder belongs to, and where it lives (docs/tiers.md#the-jobs-identity).

`shm://<run_id>/<identity>` on each node: the run id names the run (its storage.url, or
$STATEREG_RUN_ID); the identity folder names the job (world size, which ranks share a node,
its groups, storage.url), so a job never adopts another job's files. Nodes are numbered by
their first rank, so a replaced host keeps its place in the topology.

Torch-free: `statereg plan` and `statereg ls` (tiers/report.py) name the same folders and do
the same memory math as the tier engine, in well under a second.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from statereg import env

if TYPE_CHECKING:
    from statereg.engine.world import World
    from statereg.schemas.spec import RegistrySpec

RUN_ID_ENV = env.RUN_ID
IDENTITY_NAME = "identity.json"
# Room for what is not a tensor (manifests, JSON state, DCP metadata): the allowance both the
# refusal at construction and `statereg plan` add to a checkpoint's tensor bytes.
SMALL_FILES_BYTES = 16 * 1024 * 1024
_SAFE = re.compile(r"[^A-Za-z0-9_.\-]")


def run_id(spec: RegistrySpec) -> str:
    """$STATEREG_RUN_ID, else `run-` and a digest of storage.url."""
    given = env.run_id()
    if given:
        return _SAFE.sub("_", given)
    return "run-" + hashlib.sha256(spec.storage.url.encode()).hexdigest()[:12]


def run_url(spec: RegistrySpec) -> str:
    """The run's memory root, `tiers.memory.url` with {run_id} filled in (shm://NAME)."""
    assert spec.tiers is not None
    return spec.tiers.memory.url.replace("{run_id}", run_id(spec))


@dataclass(frozen=True)
class Nodes:
    """Which node each rank runs on: nodes are numbered in the order of their first rank,
    so a replaced host (another name, the same ranks) keeps its number."""

    of_rank: tuple[int, ...]

    @classmethod
    def from_names(cls, names: list[str]) -> Nodes:
        numbers: dict[str, int] = {}
        return cls(tuple(numbers.setdefault(n, len(numbers)) for n in names))

    @property
    def count(self) -> int:
        return len(set(self.of_rank))

    def ranks(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.of_rank) if n == node]

    def leader(self, node: int) -> int:
        """The node's first rank: it serves, replicates and applies retention there."""
        return self.of_rank.index(node)

    def previous(self, node: int) -> int:
        return (node - 1) % self.count


def job_identity(spec: RegistrySpec, world: World, nodes: Nodes) -> dict[str, Any]:
    """What binds a memory folder to one job: its run, world size, which ranks share a node,
    its named groups, and its durable root. Any difference is another job."""
    return {"run_id": run_id(spec), "world_size": world.size, "nodes": list(nodes.of_rank),
            "groups": {k: [list(c) for c in v] for k, v in sorted(world.layout.groups.items())},
            "storage": spec.storage.url}


def identity_folder(identity: dict[str, Any]) -> str:
    """`ws<N>-<digest>`: the folder of one job identity under shm://<run_id>."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return f"ws{identity['world_size']}-{digest}"


def node_bytes(nodes: Nodes, per_rank: list[int], node: int, replicate: bool) -> int:
    """Bytes one memory checkpoint takes in `node`'s memory: its own ranks' files (and its
    previous node's, which it holds as a replica) plus room for small files."""
    held = {node, nodes.previous(node)} if replicate else {node}
    return sum(b for r, b in enumerate(per_rank) if nodes.of_rank[r] in held) + SMALL_FILES_BYTES
