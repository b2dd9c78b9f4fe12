"""statereg's version, in a module of its own so every layer can read it without importing
the package root (whose lazy exports name every layer)."""

__version__ = "0.1.0"
