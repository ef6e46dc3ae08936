"""Benchmark scenarios run by `make bench`."""
