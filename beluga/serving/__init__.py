"""Serving: engines over a real model with the pool as their prefix cache.

Engine processes and the driver (cluster), schedulers by load or by prefix
affinity, a long-context trace, and the prefill/decode proxy for ``vllm serve``.
"""
