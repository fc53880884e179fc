"""Training a drafter from a cache: the sample stream (epoch order), the plan (sizes, optimizer),
one step (loss over the batch's blocks), the objectives and the chunked loss, the loop,
checkpoints (save, resume), the train log and the run record. The model is pipeline/drafter/."""
