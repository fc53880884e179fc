"""dflash-pipeline: train DFlash speculative-decoding drafters offline from a hidden-state cache."""

__version__ = "0.1.0"
