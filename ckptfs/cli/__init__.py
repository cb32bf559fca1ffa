"""The ``ckptfs`` command: core verbs in :mod:`.core`; lifecycle verbs (:mod:`.lifecycle`),
``doctor`` (:mod:`.doctor`) and ``bench`` (:mod:`ckptfs.bench`) plug in through
``add_subcommands``.  The demo training run is :mod:`.demo`."""

from ckptfs.cli.core import main

__all__ = ["main"]
