"""Progress bars under torchrun on a terminal (statereg/engine/report.py): every rank shares
the one terminal torchrun was started on, so only rank 0 draws, and TQDM_DISABLE=1 turns the
bars off.

The job is the real `torchrun --nproc-per-node 2` (gloo, CPU) with its stderr on a pseudo
terminal, so each rank's stderr is a terminal as it is for a user who runs it in a shell.
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import shutil
import struct
import subprocess
import sys
import termios
import textwrap
from pathlib import Path

import pytest

# Both ranks save a per_rank component (so each writes bytes of its own: a rank that draws
# would draw a bar) and load it back.
JOB = textwrap.dedent("""
    import sys

    import torch
    import torch.distributed as dist

    import statereg

    dist.init_process_group("gloo")
    state = torch.nn.Linear(256, 256)
    spec = {"storage": {"url": sys.argv[1]},
            "components": {"model": {"kind": "model", "sharing": "per_rank"}}}
    with statereg.CheckpointManager(spec, model=state) as mgr:
        mgr.save(step=1)
        assert mgr.load().step == 1
    dist.destroy_process_group()
""")


def torchrun() -> str:
    found = Path(sys.executable).with_name("torchrun")
    if not found.exists():
        pytest.skip("torchrun is not installed beside this python")
    return str(found)


def run_on_a_terminal(tmp_path: Path, **env: str) -> str:
    """What `torchrun --nproc-per-node 2 job.py` writes on its terminal (stderr and stdout)."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    root = tmp_path / "ckpt"
    shutil.rmtree(root, ignore_errors=True)
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    environ = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    environ.update(PYTHONPATH=os.pathsep.join(sys.path), **env)
    job = subprocess.Popen(  # --standalone: a rendezvous on a free local port
        [torchrun(), "--standalone", "--nproc-per-node", "2", str(script), str(root)],
        stdin=subprocess.DEVNULL, stdout=follower, stderr=follower, env=environ,
        cwd=tmp_path)
    os.close(follower)
    out = bytearray()
    try:
        while True:
            ready, _, _ = select.select([leader], [], [], 120)
            if not ready:
                raise AssertionError(f"no output for 120 s; so far: {out.decode()!r}")
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: every holder of the terminal's other end has closed it
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(leader)
        code = job.wait(timeout=120)
    text = out.decode(errors="replace")
    assert code == 0, text
    return text


def bars_started(text: str, description: str) -> int:
    """How many bars with `description` were drawn: tqdm draws each one first with no byte
    done (`save step_00000001:   0%|          | 0.00/263k [00:00<?, ?B/s]`), and never
    again with none (later draws follow an update)."""
    return len(re.findall(rf"{re.escape(description)}: +0%\|[^|]*\| 0\.00/", text))


def test_under_torchrun_on_a_terminal_one_rank_draws_and_tqdm_disable_silences_it(
        tmp_path: Path) -> None:
    text = run_on_a_terminal(tmp_path)
    assert bars_started(text, "save step_00000001") == 1, text
    assert bars_started(text, "load step_00000001") == 1, text

    silent = run_on_a_terminal(tmp_path, TQDM_DISABLE="1")
    assert "step_00000001" not in silent, silent
