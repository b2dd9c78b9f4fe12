"""Every environment variable statereg reads, read here and nowhere else.

One small function per variable, read when called (not at import), so a process that sets a
variable before the call it affects gets its value. docs/yaml-reference.md ("Environment
variables") lists them all with their defaults; keep the two in step.

This module imports neither torch nor any other statereg module except the errors: storage,
the declaration and the engine all read it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from statereg.errors import SpecError

# The declaration's own prefix: STATEREG_<FIELD>__<SUBFIELD> overrides a field of
# statereg.yaml (statereg.declaration.load_spec).
SPEC_PREFIX = "STATEREG_"

SHM_DIR = "STATEREG_SHM_DIR"
NODE = "STATEREG_NODE"
RUN_ID = "STATEREG_RUN_ID"
PEER_HOST = "STATEREG_PEER_HOST"
PEER_TIMEOUT_S = "STATEREG_PEER_TIMEOUT_S"
CLAIM_LEASE_S = "STATEREG_CLAIM_LEASE_S"
GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
MASTER_ADDR = "MASTER_ADDR"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
STORAGE_EMULATOR_HOST = "STORAGE_EMULATOR_HOST"
PLAIN_TORCH_SAVE = "STATEREG_PLAIN_TORCH_SAVE"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def _text(name: str) -> str:
    """The variable's value with surrounding blanks removed; "" when unset."""
    return os.environ.get(name, "").strip()


def _seconds(name: str, default: float) -> float:
    """A number of seconds; `default` when unset or empty, a SpecError naming it if not a number."""
    raw = _text(name)
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise SpecError(
            f"${name} is {raw!r}, not a number of seconds; set it to a number "
            f"(e.g. {default:g}) or unset it for the default {default:g}") from None


def spec_overrides() -> Mapping[str, str]:
    """The process's environment as load_spec reads it for STATEREG_<FIELD>__<SUBFIELD>."""
    return os.environ


def named(name: str) -> str | None:
    """A variable the user names in storage.options as ${NAME}; None when unset."""
    return os.environ.get(name)


def shm_dir() -> str:
    """$STATEREG_SHM_DIR: the folder shm:// roots live in ("" when unset: /dev/shm)."""
    return os.environ.get(SHM_DIR, "")


def node() -> str:
    """$STATEREG_NODE: this node's name for shm:// (a simulated node); "" when unset."""
    return os.environ.get(NODE, "")


def run_id() -> str:
    """$STATEREG_RUN_ID: the memory tier's run name; "" when unset (a digest of storage.url)."""
    return os.environ.get(RUN_ID, "")


def peer_host() -> str:
    """$STATEREG_PEER_HOST: the address this node's peer server listens on; "" when unset."""
    return _text(PEER_HOST)


def peer_timeout_s(default: float) -> float:
    """$STATEREG_PEER_TIMEOUT_S: seconds a peer request may take; `default` when unset."""
    return _seconds(PEER_TIMEOUT_S, default)


def claim_lease_s(default: float) -> float:
    """$STATEREG_CLAIM_LEASE_S: seconds a claim nobody renews stays live; `default` when unset."""
    return _seconds(CLAIM_LEASE_S, default)


def gloo_interface() -> str:
    """The first interface $GLOO_SOCKET_IFNAME names (the one gloo uses); "" when unset."""
    return _text(GLOO_SOCKET_IFNAME).split(",")[0].strip()


def master_addr() -> str:
    """$MASTER_ADDR: the job's rendezvous host, as torchrun sets it; "" when unset."""
    return _text(MASTER_ADDR)


def local_world_size() -> int:
    """$LOCAL_WORLD_SIZE: the ranks on this node, as torchrun sets it; 1 when unset or not a
    positive whole number (torchrun's variable, not statereg's to refuse)."""
    raw = _text(LOCAL_WORLD_SIZE)
    return int(raw) if raw.isdigit() and int(raw) > 0 else 1


def storage_emulator_host() -> str:
    """$STORAGE_EMULATOR_HOST: a GCS emulator gcsfs talks to; "" when unset."""
    return os.environ.get(STORAGE_EMULATOR_HOST, "")


def plain_torch_save() -> bool:
    """$STATEREG_PLAIN_TORCH_SAVE: write every tensor record with torch.save and read it with
    torch.load, bypassing statereg's own record code (docs/compatibility.md); False when unset.
    A SpecError naming the variable for a value that is neither on (1, true, yes, on) nor off
    (0, false, no, off, empty). statereg.dcp.torchsave reads it once per process."""
    raw = _text(PLAIN_TORCH_SAVE).lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise SpecError(f"${PLAIN_TORCH_SAVE} is {raw!r}; set it to 1 to write every record with "
                    "torch.save, or 0 (or unset it) for statereg's faster records")
