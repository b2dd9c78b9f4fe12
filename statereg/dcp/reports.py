"""What one rank tells the coordinator about the items it wrote, packed (`ItemReports`).

A save that reuses its DCP plans (engine/layouts/dcp.py `SavePlans`) sends these instead of
DCP's write results: each file name and descriptor list once, four integers and a digest per
item, and only the digests when the locations equal the previous save's.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from statereg.dcp.metadata import shared_descriptors
from statereg.dcp.torch_private import storage_info


@dataclass(frozen=True)
class ItemReports:
    """One rank's write results of one DCP save, in its plan's item order, packed for the
    coordinator that writes `.metadata`.

    Each file name and descriptor list travels once; each item is four integers of location
    (file, offset, length, descriptor) and its xxh3_64. `locations` is None when they equal
    those of the rank's previous save of the same plan (uncompressed items of unchanged
    shapes land where they landed before): then only the digests travel, 8 bytes per item.
    """

    paths: tuple[str, ...]
    descriptors: tuple[tuple[str, ...] | None, ...]
    locations: array | None  # 4 per item: path id, offset, length, descriptor id
    checksums: array  # xxh3_64 of each item's stored bytes
    unchecked: tuple[int, ...] = ()  # items without a digest (reused from an older save)

    def to_send(self, previous: ItemReports | None) -> ItemReports:
        """These reports, without the locations when `previous` (the last save's) had them."""
        if (previous is not None and previous.paths == self.paths
                and previous.descriptors == self.descriptors
                and previous.locations == self.locations):
            return dataclasses.replace(self, locations=None)
        return self


def pack_results(indices: Sequence[MetadataIndex], results: Sequence[WriteResult],
                 ) -> ItemReports:
    """`results` (one per item of a plan whose items are `indices`) as ItemReports."""
    position = {index: n for n, index in enumerate(indices)}
    if len(results) != len(position):
        raise ValueError(f"{len(results)} write results for a plan of {len(position)} items")
    ordered: list[Any] = [None] * len(results)
    for wr in results:  # in plan order: ids then do not depend on which thread wrote first
        ordered[position[wr.index]] = wr.storage_data
    locations = array("Q", bytes(32 * len(results)))
    checksums = array("Q", bytes(8 * len(results)))
    paths: dict[str, int] = {}
    descriptors: dict[tuple[str, ...] | None, int] = {}
    unchecked = []
    for n, (info, checksum) in enumerate(ordered):
        locations[4 * n] = paths.setdefault(info.relative_path, len(paths))
        locations[4 * n + 1] = info.offset
        locations[4 * n + 2] = info.length
        key = tuple(info.transform_descriptors) if info.transform_descriptors else None
        locations[4 * n + 3] = descriptors.setdefault(key, len(descriptors))
        if checksum is None:
            unchecked.append(n)
        else:
            checksums[n] = checksum
    return ItemReports(tuple(paths), tuple(descriptors), locations, checksums, tuple(unchecked))


def unpack_results(indices: Sequence[MetadataIndex], reports: ItemReports,
                   previous: ItemReports | None) -> tuple[list[WriteResult], ItemReports]:
    """The write results `reports` stand for, and the reports whole (locations filled in
    from `previous`, the same rank's last reports, when they did not travel)."""
    if len(reports.checksums) != len(indices):
        raise ValueError(f"item reports of {len(reports.checksums)} items for a plan of "
                         f"{len(indices)} items")
    if reports.locations is None:
        if previous is None or previous.locations is None:
            raise ValueError("item reports without locations, and no earlier ones to take "
                             "them from")
        reports = dataclasses.replace(reports, locations=previous.locations)
    locations = reports.locations
    assert locations is not None
    unchecked = set(reports.unchecked)
    descriptors = [shared_descriptors(d) if d else None for d in reports.descriptors]
    results = []
    for n, index in enumerate(indices):
        path, offset, length, descriptor = locations[4 * n:4 * n + 4]
        results.append(WriteResult(
            index=index, size_in_bytes=length,
            storage_data=(storage_info(reports.paths[path], offset, length,
                                       descriptors[descriptor]),
                          None if n in unchecked else reports.checksums[n])))
    return results, reports
