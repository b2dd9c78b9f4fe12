"""Drop-in statereg for the trainers people use: one module per framework, each importing its
framework lazily (`import statereg` imports none of them). See docs/integrations/index.md."""
