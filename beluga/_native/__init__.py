"""Beluga's C core (see memops.c for the design).  Import it through beluga.coherence."""

from beluga._native import _core
from beluga.errors import CoherenceError, RpcError

_core._register_errors(CoherenceError, RpcError)
