"""The DFlash drafter (DESIGN 2): model, anchors, loss and metrics."""
