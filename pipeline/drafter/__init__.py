"""The DFlash drafter (DESIGN 2): its config, the model (incremental reuses it for decoding), the
attention rule's masks and the ways to compute it (attention_rule), its draft-vocabulary head
(vocab) and its export. What trains it (anchors, batches, losses, metrics, its geometry from a
cache and target, the refusals of an incompatible cache) is pipeline/training/."""
