"""`save_record`: one tensor's `torch.save` record, by the fastest path this process trusts.

In order: `torch.save` itself when the switch says so (`STATEREG_PLAIN_TORCH_SAVE=1`), for a
tensor that is not a plain strided one, or when this torch failed the writer's probe
(`crc_stream.writer_checked`); a template of the tensor's layout (`templates.py`) for one of
at most 64 MiB; torch's own writer with statereg's CRC-32s (`crc_stream.py`) otherwise. Every
path writes `torch.save`'s bytes (with `crcs` False, those of `torch.save` with its CRC-32
option off, except on the first path, which always has them).
"""

from __future__ import annotations

from typing import Any

import torch

from statereg.dcp.torchsave import crc_stream, layout, templates


def save_record(tensor: torch.Tensor, out: Any, sliced: bool = True,
                crcs: bool = True) -> None:
    """Write `torch.save(tensor)`'s bytes to `out`, its CRC-32s computed here, or left zero
    with `crcs` False; `sliced` hands the payload on in `layout.SLICE` pieces (False for an
    encoder that wants it in one write).

    `tensor` is a CPU tensor whose storage it covers exactly (the writer clones any other).
    Anything but a plain strided tensor (a subclass, a sparse or quantized one, whose records
    this package has not been checked against) goes to torch.save itself, with CRC-32s.
    """
    plain = (type(tensor) is torch.Tensor and tensor.layout == torch.strided
             and not tensor.is_quantized)
    if not plain or layout.plain_torch_save() or not crc_stream.writer_checked():
        torch_save(tensor, out)
        return
    nbytes = tensor.untyped_storage().nbytes()
    if (nbytes <= templates.TEMPLATED_UP_TO and not tensor.is_conj() and not tensor.is_neg()
            and not tensor.__dict__  # what else torch pickles with a tensor
            and templates.templates_checked()
            and templates.write_templated(tensor, nbytes, out, sliced, crcs)):
        return
    crc_stream.save_crc_records(tensor, out, sliced, crcs)


def torch_save(obj: Any, out: Any) -> None:
    """`torch.save(obj, out)`, raising the stream's own error where a write failed: torch's
    writer, finishing the archive on the way out, replaces it with a RuntimeError about the
    zip's position ("unexpected pos"), which would hide a full disk from the caller."""
    try:
        torch.save(obj, out)
    except RuntimeError as exc:
        if isinstance(exc.__context__, OSError):
            raise exc.__context__ from None
        raise
