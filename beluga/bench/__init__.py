"""Benchmarks behind ``beluga bench``: each returns named figures and a table."""
