"""Convergence diagnostics over train_log.jsonl files (`pipeline report`): the logs as the report
reads them (logs), the statistics (stats), the diagnostics and runs compared (analysis), the plots
(plots), and the same checks on the trailing window while a run trains (live)."""
