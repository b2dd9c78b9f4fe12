"""The sections and helpers of benchmarks/suite.py (see docs/performance.md)."""
