"""CheckpointManager: objects meet declarations at construction; attach, peek, latest, list."""

from __future__ import annotations

import copy

import pytest
import torch

import statereg


def batches_of(loader, n: int) -> list[torch.Tensor]:
    it = iter(loader)
    return [next(it)[0] for _ in range(n)]


# -- objects and declarations ------------------------------------------------------------


def test_an_object_without_a_declaration_is_refused_listing_the_declared(make_spec, make_model):
    spec = make_spec("model", "optimizer")
    model = make_model()
    with pytest.raises(statereg.SpecError) as info:
        statereg.CheckpointManager(spec, model=model,
                                   optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                   ema=object())
    message = str(info.value)
    assert "ema=..." in message
    assert "declared components: model, optimizer" in message
    assert "Add 'ema' under 'components:'" in message


def test_a_required_declaration_without_an_object_is_refused(make_spec, make_model):
    spec = make_spec("model", "optimizer", "scheduler")
    with pytest.raises(statereg.SpecError) as info:
        statereg.CheckpointManager(spec, model=make_model())
    message = str(info.value)
    assert "declared components without an object: optimizer, scheduler" in message
    assert "required: false" in message


def test_an_optional_declaration_may_be_left_out(make_spec, make_model):
    spec = make_spec("model", components={"dataloader": {"kind": "dataloader",
                                                          "required": False}})
    mgr = statereg.CheckpointManager(spec, model=make_model())
    url = mgr.save(step=1)

    assert list(statereg.read_manifest(url).components) == ["model"]


def test_an_object_for_an_rng_component_is_refused(make_spec, make_model):
    spec = make_spec("model", "rng")
    with pytest.raises(statereg.SpecError) as info:
        statereg.CheckpointManager(spec, model=make_model(), rng=torch.Generator())
    message = str(info.value)
    assert "component 'rng' is kind 'rng', which takes no object" in message
    assert "remove the keyword" in message


def test_an_rng_component_needs_no_object(make_spec, make_model):
    mgr = statereg.CheckpointManager(make_spec("model", "rng"), model=make_model())
    url = mgr.save(step=1)
    assert statereg.read_manifest(url).components["rng"].files == ["rng/rank_00000.json"]


def test_an_object_without_state_dict_is_refused(make_spec, make_model):
    spec = make_spec("model", "scheduler")
    with pytest.raises(statereg.SpecError, match=r"'scheduler'.*without state_dict\(\)"):
        statereg.CheckpointManager(spec, model=make_model(), scheduler=object())


def test_the_spec_may_be_a_yaml_path(tmp_path, make_model):
    path = tmp_path / "statereg.yaml"
    path.write_text(f"storage: {{url: {tmp_path / 'run'}}}\n"
                    "components: {model: {kind: model}}\n")
    mgr = statereg.CheckpointManager(path, model=make_model())

    assert mgr.save(step=1) == str(tmp_path / "run" / "step_00000001")


def test_attach_refuses_an_undeclared_object(make_spec, make_model):
    mgr = statereg.CheckpointManager(make_spec("model"), model=make_model())
    with pytest.raises(statereg.SpecError, match=r"loader=\.\.\. has no declaration"):
        mgr.attach(loader=[1, 2, 3])


# -- attach: objects built after load() --------------------------------------------------


@pytest.fixture
def late_loader_spec(make_spec):
    return make_spec("model", components={"dataloader": {"kind": "dataloader",
                                                          "required": False}})


@pytest.fixture
def saved_mid_epoch(late_loader_spec, make_model, make_loader):
    """A checkpoint saved after 3 of 10 batches; returns the next 3 batches it would give."""
    torch.manual_seed(0)
    loader = make_loader()
    mgr = statereg.CheckpointManager(late_loader_spec, model=make_model(), dataloader=loader)
    it = iter(loader)
    for _ in range(3):
        next(it)
    mgr.save(step=3)
    return [next(it)[0] for _ in range(3)]


def test_attach_after_load_applies_the_pending_state_once(late_loader_spec, make_model,
                                                          make_loader, saved_mid_epoch):
    mgr = statereg.CheckpointManager(late_loader_spec, model=make_model(seed=1))
    result = mgr.load()
    assert result.components == ("model", "dataloader")

    torch.manual_seed(1)
    loader = make_loader()
    mgr.attach(dataloader=loader)
    resumed = batches_of(loader, 3)
    for got, want in zip(resumed, saved_mid_epoch, strict=True):
        assert torch.equal(got, want)

    torch.manual_seed(1)
    second = make_loader()
    torch.manual_seed(1)
    untouched = make_loader()
    mgr.attach(dataloader=second)  # nothing pending any more: a fresh loader stays fresh
    for got, want in zip(batches_of(second, 3), batches_of(untouched, 3), strict=True):
        assert torch.equal(got, want)


def test_attaching_an_iterated_loader_raises_load_order_error(late_loader_spec, make_model,
                                                              make_loader, saved_mid_epoch):
    mgr = statereg.CheckpointManager(late_loader_spec, model=make_model(seed=1))
    mgr.load()

    loader = make_loader()
    next(iter(loader))
    with pytest.raises(statereg.LoadOrderError) as info:
        mgr.attach(dataloader=loader)
    message = str(info.value)
    assert "component 'dataloader'" in message
    assert "already iterated" in message
    assert "before the first iter(loader)" in message


def test_load_refuses_an_iterated_loader_before_changing_any_component(make_spec, make_model,
                                                                        make_loader):
    spec = make_spec("model", "dataloader")
    statereg.CheckpointManager(spec, model=make_model(seed=0),
                               dataloader=make_loader()).save(step=1)

    model, loader = make_model(seed=1), make_loader()
    next(iter(loader))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(statereg.LoadOrderError):
        statereg.CheckpointManager(spec, model=model, dataloader=loader).load()
    for key, value in before.items():
        assert torch.equal(model.state_dict()[key], value), key


def test_a_loader_whose_state_was_only_saved_can_still_be_loaded_into(make_spec, make_model,
                                                                       make_loader):
    # Saving calls loader.state_dict(); that alone does not start an epoch.
    spec = make_spec("model", "dataloader")
    loader = make_loader()
    mgr = statereg.CheckpointManager(spec, model=make_model(), dataloader=loader)
    mgr.save(step=0)

    assert mgr.load().step == 0


# -- looking at checkpoints ---------------------------------------------------------------


def test_peek_reads_the_bookkeeping_without_loading(make_spec, make_model, tmp_path):
    spec = make_spec("model", "rng")
    mgr = statereg.CheckpointManager(spec, model=make_model(seed=0))
    mgr.save(step=5, tokens_seen=2048, extra={"loss": 1.5})
    mgr.save(step=9, tokens_seen=4096, extra={"loss": 0.75, "tag": "best"})

    model = make_model(seed=1)
    before = copy.deepcopy(model.state_dict())
    torch.manual_seed(3)
    rng_before = torch.get_rng_state()
    other = statereg.CheckpointManager(spec, model=model)
    info = other.peek()

    assert info.step == 9
    assert info.tokens_seen == 4096
    assert info.extra == {"loss": 0.75, "tag": "best"}
    assert info.path == str(tmp_path / "ckpt" / "step_00000009")
    assert info.components == ("model", "rng")
    assert other.peek(str(tmp_path / "ckpt" / "step_00000005")).extra == {"loss": 1.5}
    assert other.peek(step=5).path == str(tmp_path / "ckpt" / "step_00000005")
    with pytest.raises(statereg.CheckpointNotFoundError,
                       match=r"step 7 has no committed checkpoint .*; committed steps: 5, 9"):
        other.peek(step=7)
    assert torch.equal(torch.get_rng_state(), rng_before)
    for key, value in before.items():
        assert torch.equal(model.state_dict()[key], value)


def test_latest_and_list(make_spec, make_model, tmp_path):
    mgr = statereg.CheckpointManager(make_spec("model"), model=make_model())
    assert mgr.latest() is None
    assert mgr.list() == []

    urls = [mgr.save(step=s) for s in (1, 2, 3)]

    root = tmp_path / "ckpt"
    assert urls == [str(root / f"step_0000000{s}") for s in (1, 2, 3)]
    assert mgr.list() == urls
    assert mgr.latest() == urls[-1]


def test_latest_and_list_see_checkpoints_saved_by_another_manager(make_spec, make_model):
    spec = make_spec("model")
    reader = statereg.CheckpointManager(spec, model=make_model())
    writer = statereg.CheckpointManager(spec, model=make_model())
    url = writer.save(step=42)

    assert reader.latest() == url
    assert reader.list() == [url]


def test_the_manager_is_a_context_manager_that_waits(make_spec, make_model):
    spec = make_spec("model", save={"async": "thread"})
    with statereg.CheckpointManager(spec, model=make_model()) as mgr:
        url = mgr.save(step=1)
    assert statereg.read_manifest(url).step == 1


def test_load_returns_none_when_there_is_nothing_to_resume(make_spec, make_model):
    model = make_model()
    before = copy.deepcopy(model.state_dict())
    assert statereg.CheckpointManager(make_spec("model"), model=model).load() is None
    for key, value in before.items():
        assert torch.equal(model.state_dict()[key], value)


def test_a_checkpoint_from_another_root_can_be_loaded_by_url(make_spec, make_model, tmp_path):
    pretrain = make_model(seed=0)
    source = statereg.CheckpointManager(make_spec("model", url=str(tmp_path / "pretrain")),
                                        model=pretrain)
    url = source.save(step=100)

    model = make_model(seed=1)
    mgr = statereg.CheckpointManager(make_spec("model", url=str(tmp_path / "finetune")),
                                     model=model)
    result = mgr.load(url)

    assert result.step == 100
    assert result.path == url
    assert torch.equal(model.fc1.weight, pretrain.fc1.weight)
    assert mgr.list() == []


def test_a_path_that_names_no_checkpoint_is_refused_not_read_from_the_cwd(
        make_spec, make_model, tmp_path, monkeypatch):
    """load(path="/") once read ./manifest.json from the current directory."""
    mgr = statereg.CheckpointManager(make_spec("model"), model=make_model())
    mgr.save(step=1)
    monkeypatch.chdir(tmp_path / "ckpt" / "step_00000001")  # a manifest.json right here
    for path in ("/", "s3://", "memory://"):
        with pytest.raises(statereg.CheckpointNotFoundError, match="names no checkpoint"):
            mgr.load(path)
    assert mgr.load(".").step == 1  # '.' inside a checkpoint names that checkpoint


# -- save() refuses what no manifest reader would read back (issue 25, case 5) -------------


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"step": 2**64}, r"save\(step=18446744073709551616\): step must be a non-negative int, "
                      r"at most 2\*\*64-1"),
    ({"step": 10**5000}, r"save\(step=<about 5001 digits>\)"),
    ({"tokens_seen": 2**64 + 1}, r"save\(tokens_seen=18446744073709551617\): tokens_seen must "
                                 r"be a non-negative int, at most 2\*\*64-1"),
    ({"extra": {"n": 10**5000}}, r"holds the integer <about 5001 digits>, outside the 64-bit"),
    ({"extra": {"n": -(2**63) - 1}}, r"holds the integer -9223372036854775809"),
    ({"extra": {"by_id": {7: "x"}}}, r"holds the key 7 \(a dict key that is not a string\)"),
])
def test_save_refuses_values_no_manifest_reader_reads_back(tmp_path, make_spec, make_model,
                                                           kwargs, message):
    mgr = statereg.CheckpointManager(make_spec("model", save={"keep_last": 1}),
                                     model=make_model())
    mgr.save(step=1)
    with pytest.raises(statereg.SpecError, match=message):
        mgr.save(**{"step": 2, **kwargs})
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest", "step_00000001"]
    # The largest values a reader keeps exactly save, load and leave retention working.
    big = 2**64 - 1
    mgr.save(step=big, tokens_seen=big, extra={"lo": -(2**63), "hi": big})
    assert [u.rsplit("/", 1)[1] for u in mgr.list()] == [f"step_{big}"]
    result = statereg.CheckpointManager(make_spec("model"), model=make_model(1)).load()
    assert (result.step, result.tokens_seen, result.extra) == (big, big,
                                                               {"lo": -(2**63), "hi": big})


# -- a resume that falls back says why, newest first (issue 25, case 7) --------------------


def test_a_resume_past_a_damaged_newest_into_an_older_one_lacking_a_component_names_both(
        tmp_path, make_spec, make_model):
    model = make_model()
    statereg.CheckpointManager(make_spec("model"), model=model).save(step=1)
    both = make_spec("model", "optimizer")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    statereg.CheckpointManager(both, model=model, optimizer=optimizer).save(step=2)
    damaged = tmp_path / "ckpt" / "step_00000002" / "model" / "__0_0.distcp"
    damaged.write_bytes(damaged.read_bytes()[:-8])

    fresh = make_model(1)
    mgr = statereg.CheckpointManager(both, model=fresh,
                                     optimizer=torch.optim.SGD(fresh.parameters(), lr=0.1))
    with pytest.raises(statereg.CorruptCheckpointError) as info:
        mgr.load()
    message = str(info.value)
    newest, older = message.index("step_00000002 is damaged"), message.index("step_00000001:")
    assert newest < older
    assert "__0_0.distcp" in message[:older]  # the newest's damage, named first
    assert "has no component 'optimizer'" in message[older:]  # then why the older was no use
    assert "exclude=" in message


# -- a checkpoint outside the run's root takes its own storage options (issue 25, case 10) --


def model_spec(url: str, options: dict) -> dict:
    return {"storage": {"url": url, "options": options}, "components": {"model": {"kind": "model"}}}


def test_a_load_outside_the_runs_root_takes_its_own_storage_options_never_the_runs(
        request, tmp_path, make_model, monkeypatch):
    """Pre-training on moto; the fine-tune's own root on local disk, then on SeaweedFS (another
    S3 server: another endpoint). The run's storage.options are for its own root only."""
    import uuid

    from storage_servers import new_bucket, s3_options

    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID",
                 "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    moto = s3_options(request.getfixturevalue("s3_server").endpoint)
    pretrain_url = f"s3://{new_bucket(request.getfixturevalue('s3_admin'))}/pretrain"
    weights = make_model(3)
    url = statereg.CheckpointManager(model_spec(pretrain_url, moto),
                                     model=weights).save(step=7)
    seaweed = s3_options(request.getfixturevalue("seaweedfs_server").endpoint)
    seaweed_url = (f"s3://{request.getfixturevalue('seaweedfs_bucket')}/"
                   f"finetune-{uuid.uuid4().hex[:12]}")
    runs = {"local": (str(tmp_path / "finetune"), {}), "seaweedfs": (seaweed_url, seaweed)}
    for kind, (root, options) in runs.items():
        fresh = make_model(4)
        mgr = statereg.CheckpointManager(model_spec(root, options), model=fresh)
        result = mgr.load(url, storage_options=moto)
        assert result is not None and result.step == 7, kind
        for key, value in weights.state_dict().items():
            assert torch.equal(fresh.state_dict()[key], value), (kind, key)
        assert mgr.peek(url, storage_options=moto).step == 7
        mgr.save(step=8)  # the run's own root still takes the run's options
        assert mgr.list() == [f"{root}/step_00000008"]
    with pytest.raises(statereg.SpecError, match=r"storage_options=.*outside this run's root"):
        mgr.load(step=8, storage_options=moto)
    # Without storage_options, the other root opens with the environment's defaults, never
    # with the run's options (those name SeaweedFS's endpoint: moto's bucket is not there).
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto["client_kwargs"]["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", moto["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", moto["secret"])
    import s3fs  # a filesystem made before the variables were set would be reused

    s3fs.S3FileSystem.clear_instance_cache()
    fresh = make_model(5)
    mgr = statereg.CheckpointManager(model_spec(seaweed_url, seaweed), model=fresh)
    assert mgr.load(url).step == 7
    assert torch.equal(fresh.fc1.weight, weights.fc1.weight)
