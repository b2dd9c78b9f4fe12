"""The private names of torch's DataLoader and torchdata's StatefulDataLoader that statereg's
dataloader adapter uses (statereg/state/objects.py, one block) mean, on the pinned releases,
what the adapter takes them to mean; a loader without the iterator hook resumes with one
warning that says what is lost, not silently."""

from __future__ import annotations

import pytest
import torch

from statereg.state.objects import (
    BUILD_ITERATOR,
    LIVE_ITERATOR,
    STATE_DICT_ITERATOR,
    DataloaderAdapter,
)

torchdata = pytest.importorskip("torchdata.stateful_dataloader")


def loader(cls: type = torchdata.StatefulDataLoader) -> torch.utils.data.DataLoader:
    return cls(list(range(12)), batch_size=2, shuffle=True,
               generator=torch.Generator().manual_seed(0))


def test_the_names_mean_what_the_adapter_takes_them_to_mean() -> None:
    for cls in (torch.utils.data.DataLoader, torchdata.StatefulDataLoader):
        assert callable(getattr(cls, BUILD_ITERATOR))
    fresh = loader()
    assert getattr(fresh, LIVE_ITERATOR) is None  # not iterated yet
    fresh.state_dict()  # builds an iterator without iterating, flagged as such
    assert getattr(fresh, LIVE_ITERATOR) is not None and getattr(fresh, STATE_DICT_ITERATOR)
    iterated = loader()
    next(iter(iterated))
    assert getattr(iterated, LIVE_ITERATOR) is not None
    assert not getattr(iterated, STATE_DICT_ITERATOR)


def test_a_restore_builds_the_resumed_iterator_outside_the_global_rng() -> None:
    saved = loader()
    it = iter(saved)
    next(it)
    state = saved.state_dict()
    expected = [batch.tolist() for batch in it]
    torch.manual_seed(5)
    after_seed = torch.rand(3)
    resumed = loader()
    DataloaderAdapter("loader", "dataloader", resumed).restore(state)
    torch.manual_seed(5)
    assert [batch.tolist() for batch in resumed] == expected
    assert torch.equal(torch.rand(3), after_seed)  # building it drew nothing from the global RNG


def test_a_loader_without_the_hook_warns_once_per_restore_naming_what_is_lost() -> None:
    class NoHook(torchdata.StatefulDataLoader):
        _get_iterator = None  # as on a torch that renamed it

    saved = loader()
    next(iter(saved))
    with pytest.warns(RuntimeWarning, match=r"component 'loader': NoHook has no "
                      r"_get_iterator\(\).*draw one more seed"):
        DataloaderAdapter("loader", "dataloader", loader(NoHook)).restore(saved.state_dict())
