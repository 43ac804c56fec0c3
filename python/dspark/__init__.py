"""dspark: collective communication for distributed training, from Python.

- :class:`Communicator` runs dspark's collectives on numpy arrays and torch CPU tensors, in
  place and with zero copies, with the GIL released while communicating. Non-blocking forms
  (``async_op=True``) return a :class:`Work`.
- ``torch.distributed.init_process_group(backend="dspark")`` uses dspark as torch's
  collective backend. It needs no ``import dspark``: the package registers the backend
  through torch's entry points. ``import dspark.torch`` registers it explicitly.
- Errors are :class:`Error` subclasses, one per kind, with dspark's message (it names the
  rank, the peer and the operation).
"""

from ._dspark import (  # noqa: F401
    AbortedError,
    ConfigError,
    Error,
    InternalError,
    InvalidArgumentError,
    IoError,
    MismatchError,
    PeerLostError,
    TimeoutError,
    UnavailableError,
    __version__,
)
from ._comm import Communicator, Work  # noqa: F401

__all__ = [
    "Communicator",
    "Work",
    "Error",
    "TimeoutError",
    "PeerLostError",
    "MismatchError",
    "InvalidArgumentError",
    "ConfigError",
    "IoError",
    "AbortedError",
    "UnavailableError",
    "InternalError",
    "__version__",
]
