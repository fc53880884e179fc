"""The DFlash drafter (DESIGN 2): its config, the model (incremental reuses it for decoding),
its geometry from a cache and target, blocks and batches of anchors, the acceptance metrics,
export, and the refusals of an incompatible cache (compat). Training is pipeline/training/."""
