"""Test support shipped with ckptfs, so users can run the same suite against their own storage.

- `ckptfs.testing.backend`: a backend under test (run-root URL + raw backdoor).
- `ckptfs.testing.conformance`: the conformance base classes every backend subclasses.
- `ckptfs.testing.lifecycle`: the same for the training-run lifecycle
  (`CheckpointManager`).
- `ckptfs.testing.faults`: a storage wrapper that injects crashes, torn writes, power cuts
  and transient faults at chosen calls.
- `ckptfs.testing.servers` (package): start real storage servers on free loopback ports,
  one module per family (``s3``: moto and ministack, ``gcs``: fake-gcs-server, ``azure``:
  azurite) over the shared process and port machinery (``process``).
- `ckptfs.testing.reliability` (package): the crash-point, power-cut, race, corruption,
  transient-fault and hostile-input sweeps, one module each, and the command that writes
  docs/reliability.md (``python -m ckptfs.testing.reliability``).

Importing this package needs pytest (the ``test`` extra).
"""

from ckptfs.testing.backend import Backend, unique_name

__all__ = ["Backend", "unique_name"]
