"""Serving: an engine over a real model, and (later) the scheduler and the vLLM connector."""
