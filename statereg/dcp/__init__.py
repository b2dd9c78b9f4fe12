"""Everything torch.distributed.checkpoint (DCP): how tensors become files on a StorageBackend.

One module per job, so a reader looking for "how are bytes encoded" or "where is private torch
used" finds it by name:

- `fs.py`: DCP's `FileSystemBase` over a StorageBackend;
- `writer.py`: `BackendWriter`, DCP's writer with statereg's per-file loop and item digests;
- `reader.py`: `BackendReader`, `SafeLoadPlanner`, `load_in_place`;
- `metadata.py`: `.metadata`, read with a restricted unpickler, and the item digests in it;
- `reports.py`: one rank's write results, packed for the coordinator (`ItemReports`);
- `reuse.py`: what an incremental save may reference instead of writing;
- `planner.py`: `StateregSavePlanner`, DCP's save planner with a one-pass path for flat dicts;
- `codec.py`: compression of each item (zstd, float planes) and DCP's extension registry;
- `torchsave/`: statereg's own `torch.save` record code (writing records with its own CRC-32s,
  adding CRC-32s, reading a payload in place), one module per job;
- `device_reads.py`: reads into GPU tensors through page-locked slices;
- `torch_private.py`: the only home of private torch names, each with its fallback;
- `quiet.py`: DCP's single-process warning, silenced during statereg's own DCP calls only.

Storage itself (`statereg.backends`) imports no torch; this package sits above it.
"""

# The file DCP keeps a directory's metadata in (one definition: formats/names.py, torch-free,
# names it too, so importing it from here must stay torch-free).
METADATA_NAME = ".metadata"
