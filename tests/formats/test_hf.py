"""format: safetensors writes a Hugging Face directory; HF directories load into live models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from torch import nn

import statereg
from statereg.cli import main


class Backbone(nn.Module):
    """An embedding, a block and an output head; `tie` shares the head with the embedding."""

    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.block = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32, bias=False)
        if tie:
            self.head.weight = self.embed.weight


def _model(seed: int, tie: bool = False) -> Backbone:
    torch.manual_seed(seed)
    return Backbone(tie)


def _spec(url: str, options: dict[str, Any] | None = None, **model: Any) -> dict[str, Any]:
    return {"storage": {"url": url, "options": options or {}},
            "components": {"model": {"kind": "model", **model}}}


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_safetensors_component_round_trips_on_every_backend(store):
    model = _model(0)
    spec = _spec(store.url, store.options, format="safetensors", max_shard_size="3KB")
    url = statereg.CheckpointManager(spec, model=model).save(step=7)

    # Paths below the writer directory where the store needs one (GCS emulator).
    record = statereg.read_manifest(url, store.options).without_writer().components["model"]
    assert record.format == "safetensors"
    shards = [f for f in record.files if f.endswith(".safetensors")]
    assert shards == [f"model/model-{i:05d}-of-{len(shards):05d}.safetensors"
                      for i in range(1, len(shards) + 1)]
    assert len(shards) > 1 and "model/model.safetensors.index.json" in record.files

    fresh = _model(1)
    result = statereg.CheckpointManager(spec, model=fresh).load(verify="full")
    assert result.step == 7 and result.verified
    assert _same_weights(fresh, model)

    # Exported to the same storage and imported from there.
    statereg.export_hf(url, f"{store.url}/hf", options=store.options)
    imported = _model(2)
    statereg.load_model_from(f"{store.url}/hf", imported, options=store.options)
    assert _same_weights(imported, model)


def test_every_shard_reads_with_safetensors_and_the_index_lists_each_tensor_once(tmp_path):
    model = _model(0)
    spec = _spec(str(tmp_path), format="safetensors", max_shard_size=2048)
    statereg.CheckpointManager(spec, model=model).save(step=1)
    directory = tmp_path / "step_00000001" / "model"

    index = json.loads((directory / "model.safetensors.index.json").read_text())
    files = sorted(directory.glob("model-*.safetensors"))
    read = {}
    for file in files:
        tensors = safetensors.torch.load_file(file)
        assert sum(t.nbytes for t in tensors.values()) <= 2048 or len(tensors) == 1
        assert not read.keys() & tensors.keys()
        read.update(tensors)
        assert all(index["weight_map"][k] == file.name for k in tensors)
    assert read.keys() == index["weight_map"].keys() == model.state_dict().keys()
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in read.values())
    for key, value in model.state_dict().items():
        assert torch.equal(read[key], value), key


def test_tied_weights_are_written_once_and_tie_again_on_load(tmp_path):
    model = _model(0, tie=True)
    spec = _spec(str(tmp_path), format="safetensors")
    url = statereg.CheckpointManager(spec, model=model).save(step=1)

    directory = tmp_path / "step_00000001" / "model"
    stored = safetensors.torch.load_file(directory / "model-00001-of-00001.safetensors")
    assert "head.weight" not in stored and "embed.weight" in stored
    assert statereg.read_manifest(url).components["model"].meta == {
        "aliases": {"head.weight": "embed.weight"}}

    fresh = _model(1, tie=True)
    statereg.CheckpointManager(spec, model=fresh).load()
    assert fresh.head.weight is fresh.embed.weight
    assert torch.equal(fresh.embed.weight, model.embed.weight)


def test_prefix_rules_name_the_stored_tensors(tmp_path):
    spec = _spec(str(tmp_path), format="safetensors", prefix={"add": "model."})
    statereg.CheckpointManager(spec, model=_model(0)).save(step=1)
    index = json.loads((tmp_path / "step_00000001/model/model.safetensors.index.json")
                       .read_text())
    assert sorted(index["weight_map"]) == ["model.block.bias", "model.block.weight",
                                           "model.embed.weight", "model.head.weight"]


def _hf_dir(path: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> Path:
    """A directory as transformers writes it: model.safetensors, or shards and an index."""
    path.mkdir()
    if shards == 1:
        safetensors.torch.save_file(tensors, path / "model.safetensors",
                                    metadata={"format": "pt"})
        return path
    names = list(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i::shards]}
        safetensors.torch.save_file(part, path / file)
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


@pytest.mark.parametrize("shards", [1, 2])
def test_a_hugging_face_directory_loads_into_a_model(tmp_path, shards):
    source = _model(0)
    hf = _hf_dir(tmp_path / "hf", {f"model.{k}": v for k, v in source.state_dict().items()},
                 shards)
    model = _model(1)
    report = statereg.load_model_from(hf, model, prefix={"add": "model."})
    assert _same_weights(model, source)
    assert (len(report.loaded), report.missing, report.unexpected) == (4, (), ())


def test_a_hugging_face_directory_is_strict_unless_told_otherwise(tmp_path):
    source = _model(0).state_dict()
    tensors = {k: v for k, v in source.items() if k != "block.bias"}
    tensors["lm_extra.weight"] = torch.ones(2)
    hf = _hf_dir(tmp_path / "hf", tensors)
    model = _model(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    with pytest.raises(statereg.CheckpointMismatchError) as err:
        statereg.load_model_from(hf, model)
    assert "block.bias" in str(err.value) and "lm_extra.weight" in str(err.value)
    assert _same_weights(model, _model(1))  # nothing changed

    report = statereg.load_model_from(hf, model, strict=False)
    assert report.missing == ("block.bias",) and report.unexpected == ("lm_extra.weight",)
    assert torch.equal(model.block.weight, source["block.weight"])
    assert torch.equal(model.block.bias, before["block.bias"])


def test_bf16_weights_load_into_a_float32_model(tmp_path):
    source = {k: v.to(torch.bfloat16) for k, v in _model(0).state_dict().items()}
    model = _model(1)
    statereg.load_model_from(_hf_dir(tmp_path / "hf", source), model)
    assert model.block.weight.dtype == torch.float32
    assert torch.equal(model.block.weight, source["block.weight"].float())


def test_manager_load_of_a_hf_directory_fills_the_model_and_says_not_verified(tmp_path):
    source = _model(0)
    hf = _hf_dir(tmp_path / "hf", dict(source.state_dict()), shards=2)
    model, optimizer = _model(1), None
    spec = _spec(str(tmp_path / "run"))
    spec["components"]["optimizer"] = {"kind": "optimizer"}
    optimizer = torch.optim.AdamW(model.parameters())
    mgr = statereg.CheckpointManager(spec, model=model, optimizer=optimizer)

    result = mgr.load(hf)
    assert (result.step, result.components, result.verified) == (0, ("model",), False)
    assert result.keys["model"].unexpected == ()
    assert _same_weights(model, source) and not optimizer.state
    with pytest.raises(statereg.SpecError, match="model components only"):
        mgr.load(hf, include=["optimizer"])


def test_a_hugging_face_directory_on_object_storage_loads(remote_store):
    source = _model(0)
    for name, tensor in source.state_dict().items():  # one file per tensor, with an index
        remote_store.fs.pipe_file(remote_store.path(f"hf/{name}.safetensors"),
                                  safetensors.torch.save({name: tensor}))
    remote_store.fs.pipe_file(remote_store.path("hf/model.safetensors.index.json"), json.dumps(
        {"weight_map": {k: f"{k}.safetensors" for k in source.state_dict()}}).encode())
    model = _model(1)
    statereg.load_model_from(f"{remote_store.url}/hf", model, options=remote_store.options)
    assert _same_weights(model, source)


def test_plan_shows_every_rank_sending_and_the_hugging_face_files(tmp_path, capsys):
    yaml_file = tmp_path / "statereg.yaml"
    yaml_file.write_text("storage: {url: ./c}\n"
                         "components: {model: {kind: model, format: safetensors}}\n")
    assert main(["plan", str(yaml_file), "--world-size", "2"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("model")]
    # Both ranks gather (the collective is the world); rank 0 leads and writes the files.
    assert len(lines) == 2 and all("world" in x and "safetensors" in x for x in lines)
    assert "leader" in lines[0] and "model/model.safetensors.index.json" in lines[0]
    assert "member" in lines[1] and "(writes nothing)" in lines[1]
