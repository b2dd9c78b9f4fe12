"""Formats other than DCP, and interop with the tools people already use.

- `files`: the hooks engine.save_steps and engine.load call for components stored as whole files
  (`safetensors`, `torch`) and for small object state (`json`, `torch`);
- `hf`: Hugging Face safetensors directories, written and read;
- `torchfile`: the `torch` format (torch.save files, loaded with weights_only=True);
- `tensors`: full tensors gathered from shards on save, sliced back into shards on load;
- `foreign`: directories written by plain torch.distributed.checkpoint (no manifest);
- `interop`: what users call: export to Hugging Face, load_model_from, foreign loads.

See docs/formats.md.
"""
