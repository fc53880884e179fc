"""Convergence diagnostics over train_log.jsonl files (`pipeline report`)."""
