"""Beluga inside the frameworks people serve with: one module per framework.

- :mod:`beluga.integrations.vllm`: a vLLM KV connector (v1 API), loaded with
  ``kv_connector_module_path``.
- :mod:`beluga.integrations.lmcache`: an LMCache storage plugin.
- :mod:`beluga.integrations.sglang`: an SGLang HiCache storage backend.

Each module imports its framework, so import only the one you run under.
"""
