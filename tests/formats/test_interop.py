"""A real client reads what statereg exports, and statereg starts from what transformers wrote.

The model is a tiny Llama built from a config (no download): hidden size 32, 2 layers, a
64-token vocabulary, output head tied to the embedding.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import statereg
from statereg.cli import main

TOKENS = torch.tensor([[1, 5, 9, 2, 33, 63, 0, 7]])


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _config() -> LlamaConfig:
    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                       max_position_embeddings=64, tie_word_embeddings=True)


def _llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(_config()).eval()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def _spec(root: Path, **model: object) -> dict:
    return {"storage": {"url": str(root)}, "components": {"model": {"kind": "model", **model}}}


@pytest.mark.parametrize("fmt", ["dcp", "safetensors"])
def test_exported_checkpoint_loads_in_transformers_with_identical_logits(tmp_path, capsys, fmt):
    model = _llama(0)
    url = statereg.CheckpointManager(_spec(tmp_path / "run", format=fmt), model=model).save(
        step=3)
    config = tmp_path / "config.json"
    _config().to_json_file(config)
    out = tmp_path / "hf"

    assert main(["export-hf", url, str(out), "--config", str(config),
                 "--max-shard-size", "20KB"]) == 0
    assert "wrote" in capsys.readouterr().out

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == {f.name for f in shards}
    stored = {}
    for shard in shards:
        stored.update(safetensors.torch.load_file(shard))
    assert len(stored) == len(index["weight_map"])  # each tensor in exactly one file
    assert "lm_head.weight" not in stored  # tied: transformers ties it again on load

    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(_logits(loaded), _logits(model))


def test_export_converts_to_bf16(tmp_path):
    model = _llama(0)
    url = statereg.CheckpointManager(_spec(tmp_path / "run"), model=model).save(step=1)
    done = statereg.export_hf(url, tmp_path / "hf", dtype="bf16")
    stored = safetensors.torch.load_file(tmp_path / "hf" / done.files[0])
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    assert done.bytes == sum(t.nbytes for t in stored.values())


def test_a_save_pretrained_directory_starts_a_fine_tune(tmp_path):
    pretrained = _llama(0)
    pretrained.save_pretrained(tmp_path / "pretrained")

    model = _llama(1)
    optimizer = torch.optim.AdamW(model.parameters())
    spec = _spec(tmp_path / "run")
    spec["components"]["optimizer"] = {"kind": "optimizer"}
    mgr = statereg.CheckpointManager(spec, model=model, optimizer=optimizer)
    result = mgr.load(tmp_path / "pretrained")

    assert result.verified is False and result.keys["model"].missing == ()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(_logits(model), _logits(pretrained))


def test_load_model_from_maps_a_prefix_for_a_bare_backbone(tmp_path):
    pretrained = _llama(0)
    pretrained.save_pretrained(tmp_path / "pretrained")
    backbone = _llama(1).model  # LlamaModel: keys without the "model." of the causal LM

    report = statereg.load_model_from(tmp_path / "pretrained", backbone, prefix={"add": "model."},
                                      strict=False)
    assert report.missing == () and report.unexpected == ()
    assert torch.equal(backbone.embed_tokens.weight, pretrained.model.embed_tokens.weight)
