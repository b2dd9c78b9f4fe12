"""The contract between statereg's integrations and the frameworks' private names.

Each integration lists the names of its framework that are not the framework's documented API
in one block (`PRIVATE_NAMES`, docs/integrations/index.md, "Private names"). Against the
releases installed here (those constraints.txt pins, which CI installs) every listed name
resolves, on the classes at import and on live objects; the releases each integration says
it is tested with are the pinned ones; and a release without a name gets statereg's own error
naming it (or, for a name a single feature needs, one warning), not an AttributeError inside
a training hook.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import statereg
from statereg.integrations._common import PrivateName, check_private_names

CONSTRAINTS = Path(__file__).parents[2] / "constraints.txt"
# integration module -> (distribution pinned in constraints.txt, its TESTED_* constant)
INTEGRATIONS = {
    "lightning": ("lightning", "TESTED_LIGHTNING"),
    "transformers": ("transformers", "TESTED_TRANSFORMERS"),
    "accelerate": ("accelerate", "TESTED_ACCELERATE"),
}


def integration(name: str) -> Any:
    """statereg.integrations.<name>, skipped where its framework is not installed."""
    pytest.importorskip(INTEGRATIONS[name][0])
    return pytest.importorskip(f"statereg.integrations.{name}")


def pinned(distribution: str) -> str:
    """The release constraints.txt pins; under CI (which installs it) also the installed one."""
    match = re.search(rf"^{re.escape(distribution)}==(\S+)$", CONSTRAINTS.read_text(), re.M)
    assert match, f"constraints.txt pins no {distribution}"
    if os.environ.get("CI") == "true":
        installed = importlib.metadata.version(distribution).partition("+")[0]
        assert installed == match.group(1), f"CI installed {distribution} {installed}"
    return match.group(1)


@pytest.mark.parametrize("name", sorted(INTEGRATIONS))
def test_each_integration_is_tested_with_the_release_ci_pins(name: str) -> None:
    distribution, constant = INTEGRATIONS[name]
    assert getattr(integration(name), constant) == pinned(distribution)


def test_accelerate_names_the_torchdata_ci_pins() -> None:
    accelerate_integration = integration("accelerate")
    tested = accelerate_integration.TESTED_TORCHDATA
    assert tested == pinned("torchdata")


@pytest.mark.parametrize("name", sorted(INTEGRATIONS))
def test_every_private_name_resolves_in_the_installed_framework(name: str) -> None:
    module = integration(name)
    names = list(module.PRIVATE_NAMES)
    if name == "accelerate":
        pytest.importorskip("torchdata")
        names.append(module.TORCHDATA_FINISHED)
    assert names
    assert {n.label: n.problem() for n in names} == {n.label: None for n in names}


def test_lightnings_names_are_on_a_live_trainer_and_wrapper() -> None:
    lightning = integration("lightning")
    import lightning.pytorch as pl

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    assert lightning._data_fetcher(trainer) is None  # made when fit() sets up its data
    assert lightning._epoch_processed(trainer) == 0
    assert lightning._ended_an_epoch(trainer) is False
    sampler = torch.utils.data.SequentialSampler(range(3))
    wrapper = lightning.SAMPLER_WRAPPER.value(sampler)
    assert lightning._wrapped_sampler(wrapper) is sampler
    lightning._list_wrapped_again(wrapper)
    assert wrapper[2] == 2


def test_accelerates_names_are_on_a_live_accelerator_and_loader() -> None:
    accelerate_integration = integration("accelerate")
    pytest.importorskip("torchdata")
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        use_stateful_dataloader=True))
    model = torch.nn.Linear(2, 2)
    loader = torch.utils.data.DataLoader(torch.arange(6.0), batch_size=2)
    model, loader = accelerator.prepare(model, loader)
    accelerator.register_for_checkpointing(torch.nn.Linear(1, 1))
    assert [len(accelerate_integration._prepared(accelerator, what))
            for what in ("models", "optimizers", "schedulers", "dataloaders",
                         "custom_objects")] == [1, 0, 0, 1, 1]
    assert accelerate_integration._shard_epoch(loader) == 0
    for _ in loader:
        pass
    # The key torchdata's own state carries at an epoch's end, read through the block.
    assert loader.state_dict()[accelerate_integration._ITERATOR_FINISHED] is True
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


# -- a release without a name ------------------------------------------------------------


def test_a_release_without_a_required_name_fails_naming_it_and_what_to_install() -> None:
    lightning = integration("lightning")
    from lightning.pytorch.loops.fit_loop import _FitLoop

    class OlderFitLoop(_FitLoop):
        """A fit loop whose constructor keeps its fetcher under another name."""

        def __init__(self) -> None:
            self.fetcher = None

    older = dataclasses.replace(lightning.FIT_LOOP_DATA_FETCHER, owner=OlderFitLoop)
    with pytest.raises(statereg.StateregError, match=re.escape(
            "statereg.integrations.lightning relies on lightning's private "
            f"{OlderFitLoop.__module__}.{OlderFitLoop.__qualname__}._data_fetcher (iterated "
            "again once the loader's saved position is given): its constructor does not set "
            "it in lightning 9.0.0; install lightning==2.6.6, the release CI tests "
            "(constraints.txt)")):
        check_private_names("statereg.integrations.lightning", "lightning", "9.0.0",
                            lightning.TESTED_LIGHTNING, [*lightning.PRIVATE_NAMES[1:], older])


def test_a_release_that_changed_an_overridden_method_fails_naming_both_signatures() -> None:
    transformers_integration = integration("transformers")
    from transformers import Trainer

    class NewerTrainer(Trainer):
        def _load_rng_state(self, checkpoint: Any, strict: bool = True) -> None:
            """As a release that added a parameter would declare it."""

    changed = [dataclasses.replace(n, owner=NewerTrainer)
               for n in transformers_integration.PRIVATE_NAMES]
    with pytest.raises(statereg.StateregError, match=re.escape(
            "._load_rng_state (applies its generators where the Trainer would): it takes "
            "(self, checkpoint, strict), not (self, checkpoint) in transformers 9.0")):
        check_private_names("statereg.integrations.transformers", "transformers", "9.0",
                            "5.23.0", changed)


def test_a_release_without_a_features_names_turns_that_feature_off_with_one_warning() -> None:
    lightning = integration("lightning")
    import lightning.pytorch.loops as without_the_wrapper  # a real module that lacks it

    feature_names = [n for n in lightning.PRIVATE_NAMES if n.feature is not None]
    assert len(feature_names) == 3
    missing = [dataclasses.replace(n, owner=without_the_wrapper) for n in feature_names]
    with pytest.warns(UserWarning) as caught:
        off = check_private_names("statereg.integrations.lightning", "lightning", "9.0.0",
                                  "2.6.6", [*lightning.PRIVATE_NAMES[:7], *missing])
    assert off == {lightning._WRAPPED}
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith("statereg.integrations.lightning: lightning 9.0.0 lacks "
                              "lightning.pytorch.loops._DatasetSamplerWrapper")
    assert "does not resume bit-exactly; lightning==2.6.6 (constraints.txt)" in message


def test_names_that_resolve_give_no_warning_and_turn_nothing_off() -> None:
    names = [PrivateName(torch.optim.Optimizer, "param_groups", "a name torch sets",
                         on_instances=True),
             PrivateName("torch.optim.Optimizer", "step", "a method",
                         parameters=("self", "closure"), feature="nothing is lost")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_private_names("x", "torch", torch.__version__, "2", names) == frozenset()


def test_importing_against_a_lightning_without_the_wrapper_warns_once_and_still_works(
        ) -> None:
    pytest.importorskip("lightning")
    script = (
        "import warnings\n"
        "import lightning.pytorch.overrides.distributed as d\n"
        "del d._DatasetSamplerWrapper  # as a release that moved it\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import statereg.integrations.lightning as sl\n"
        "ours = [w for w in caught if 'statereg.integrations.lightning' in str(w.message)]\n"
        "print(len(ours), sl._WRAPPER_CLASS, sl._wrapper_of(object()))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "None", "None"]
