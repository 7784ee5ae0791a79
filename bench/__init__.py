"""Benchmarks: each measures eventplane and its peer in the same run and reports the ratio."""
