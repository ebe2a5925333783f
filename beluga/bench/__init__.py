"""Benchmarks of Beluga's store, and the baselines they run side by side with it."""
