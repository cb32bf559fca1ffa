"""The ``ckptfs`` command: core verbs in `.core`; lifecycle verbs (`.lifecycle`),
``doctor`` (`.doctor`) and ``bench`` (`ckptfs.bench`) plug in through
``add_subcommands``.  The demo training run is `.demo`."""

from ckptfs.cli.core import main

__all__ = ["main"]
