"""Drop-in replacements for other stores' client APIs, over a Beluga pool.

- :mod:`beluga.compat.mooncake`: ``MooncakeDistributedStore`` with Mooncake
  Store's Python signatures and return codes, so code written against
  ``mooncake.store`` runs on Beluga by changing its import.
"""
