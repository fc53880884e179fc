"""Training a drafter from a cache: train's settings resolved from preset, file and flags
(configure); the drafter the run builds from its shape and the target (drafter_shape) and its mask
token (mask_token); the refusals of an incompatible cache (compat); the draft vocabulary chosen
from the cache (draft_vocab) and counted once a run (run_vocab); the sample stream (stream: epoch
order); blocks (anchors and their targets), batch (samples to one padded forward) and
micro_batches (a rank's share of a step cut by size); the plan (sizes, optimizer); one step
(loss over the batch's blocks), the objectives and the chunked loss, the metrics; the loop, a
step's line of the train log (log_line), checkpoints (save, resume), and the claim on a run
directory (run_claim). The settings are pipeline/config; the model is pipeline/drafter/."""
