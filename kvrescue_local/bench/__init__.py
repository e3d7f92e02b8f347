"""Benchmarks: datasets, grading, resumable sweeps, reports."""
