"""Test support shipped with ckptfs, so users can run the same suite against their own storage.

- :mod:`ckptfs.testing.backend`: a backend under test (run-root URL + raw backdoor).
- :mod:`ckptfs.testing.conformance`: the conformance base classes every backend subclasses.
- :mod:`ckptfs.testing.servers`: start real storage servers (moto, ministack, fake-gcs-server,
  azurite) on free loopback ports.

Importing this package needs pytest (the ``test`` extra).
"""

from .backend import Backend, unique_name

__all__ = ["Backend", "unique_name"]
