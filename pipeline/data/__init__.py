"""The training data before the target sees it: conversations (the one reader: JSONL or Parquet,
messages or ShareGPT, tools, template kwargs), loss_mask (from the target's own chat template),
samples (rows -> samples: extract writes by it and verify-cache re-derives by it), prompts (eval's)
and self_agreement (a target predicts the data it wrote)."""
