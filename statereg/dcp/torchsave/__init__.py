"""statereg's own `torch.save` record code, in one place: every tensor item of a DCP file is
one `torch.save` zip, and this package writes, re-CRCs and reads those zips faster than torch
does, byte for byte as torch writes them.

It depends on how torch's writer lays a record out (the order of the zip's pieces, the record
names, the serialization id, the alignment, the CRC-32s, the pickled storage reference):
docs/compatibility.md lists each assumption, what breaks if torch changes it, and which test
or runtime check notices. Each job checks itself once per process against torch's own
`torch.save` / `torch.load` on small probes and, where they differ, warns once and leaves the
job to torch. `STATEREG_PLAIN_TORCH_SAVE=1` (`statereg.env.plain_torch_save`) bypasses all of
it: records are written by `torch.save`, given CRC-32s by `torch.load` and `torch.save`, and
read by `torch.load`.

One module per job:

- `layout.py`: the zip signatures, header layouts, record names and hashes it relies on;
- `crc_stream.py`: a record from torch's own zip writer, its CRC-32s computed by statereg;
- `templates.py`: a record of a layout seen before, from that layout's template;
- `write.py`: `save_record`, which picks among `torch.save` and the two above;
- `crcs.py`: `add_crcs`, CRC-32s for a record written without them (the memory tier's drain);
- `read.py`: `read_into`, a record's payload read in place, and `load`, the bounded
  `torch.load` every other record goes through.
"""

from statereg.dcp.torchsave.crcs import RecordError, add_crcs
from statereg.dcp.torchsave.read import (
    RECORD_ERRORS,
    RecordWindow,
    byte_view,
    check_bounded,
    frames,
    load,
    read_into,
)
from statereg.dcp.torchsave.write import save_record

__all__ = ["RECORD_ERRORS", "RecordError", "RecordWindow", "add_crcs", "byte_view",
           "check_bounded", "frames", "load", "read_into", "save_record"]
