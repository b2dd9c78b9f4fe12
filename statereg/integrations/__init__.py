"""statereg inside the trainers people use: one module per framework.

- `statereg.integrations.transformers`: `StateregTrainer` (or `with_statereg(YourTrainer)`),
  a drop-in Hugging Face `Trainer` whose checkpoints are statereg checkpoints
  (docs/integrations/transformers.md).
- `statereg.integrations.accelerate`: `save_state(accelerator, mgr_or_spec, step)` and
  `load_state(accelerator, mgr_or_spec)`, statereg's equivalents of `Accelerator.save_state`
  and `load_state` (docs/integrations/accelerate.md).

Each module imports its framework when it is imported itself, never before: `import statereg`
(and this package) import no trainer framework.
"""
