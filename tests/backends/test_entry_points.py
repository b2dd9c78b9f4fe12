"""A third-party package adds a backend through the `statereg.backends` entry-point group."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PLUGIN = '''
import fsspec
from statereg.backends.base import StorageBackend


class AcmeBackend(StorageBackend):
    """acme://NAME stores checkpoints in fsspec's memory filesystem under /acme/NAME."""

    schemes = ("acme",)

    def _open_filesystem(self, url, options):
        return fsspec.filesystem("memory"), "/acme/" + url.split("://", 1)[1]
'''

SCRIPT = '''
import torch, statereg
model = torch.nn.Linear(4, 4)
spec = {"storage": {"url": "acme://run1"}, "components": {"model": {"kind": "model"}}}
url = statereg.CheckpointManager(spec, model=model).save(step=1)
other = torch.nn.Linear(4, 4)
statereg.CheckpointManager(spec, model=other).load(verify="full")
assert torch.equal(model.weight, other.weight)
import fsspec
print(url, sorted(fsspec.filesystem("memory").ls("/acme/run1/step_00000001", detail=False)))
'''


def install_plugin(site: Path, module: str, target: str) -> None:
    """A minimal installed distribution: a module plus dist-info with one entry point."""
    (site / "acme_store.py").write_text(module)
    info = site / "acme_store-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-store\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[statereg.backends]\nacme = {target}\n")


def run_with(site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get(
        "PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=env, timeout=120)


def test_an_installed_package_registers_a_backend_without_touching_statereg(tmp_path):
    install_plugin(tmp_path, PLUGIN, "acme_store:AcmeBackend")
    done = run_with(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("acme://run1/step_00000001 ")
    assert "/acme/run1/step_00000001/manifest.json" in done.stdout


def test_a_broken_plugin_is_named_in_a_clear_error(tmp_path):
    install_plugin(tmp_path, "raise ImportError('acme needs libfoo')\n",
                   "acme_store:AcmeBackend")
    done = run_with(tmp_path)
    assert done.returncode != 0
    assert "SpecError: storage backend entry point 'acme' (acme_store:AcmeBackend" in done.stderr
    assert "acme needs libfoo" in done.stderr
