"""Training a drafter from a cache: its geometry from the cache and target and the refusals of an
incompatible cache (compat); the sample stream (epoch order); blocks (anchors and their targets)
and batch (samples to one padded forward); the plan (sizes, optimizer); one step (loss over the
batch's blocks), the objectives and the chunked loss, the metrics; the loop, checkpoints (save,
resume), the train log and the run record. The model is pipeline/drafter/."""
