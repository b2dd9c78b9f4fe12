"""statereg for the trainers people use: one module per framework, each imported only when used.

- `statereg.integrations.lightning`: `StateregCheckpoint`, a Lightning Callback;
- `statereg.integrations.transformers`: the Hugging Face Trainer;
- `statereg.integrations.accelerate`: `save_state` / `load_state` for an Accelerator;
- `statereg.integrations.torchtitan`: a TorchTitan-style checkpointer.

Importing this package imports no framework (docs/integrations/index.md).
"""
