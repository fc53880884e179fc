"""Settings: what each command may be told, declared once and loaded in one order.

- fields.py: `option(...)`, a dataclass field that is also a flag; the flag parsers.
- tables.py: TOML files, presets and flags merged (defaults < preset < file < flags).
- extract.py: ExtractConfig, `pipeline extract`'s flat [extract] table.
- train.py: TrainConfig, `pipeline train`'s components (job, data, drafter, objective, optimizer,
  schedule, tracking), a TOML table each.

Nothing here imports the rest of the library but its errors: every package may read its settings.
"""

from pipeline.config.extract import ExtractConfig
from pipeline.config.fields import EMBEDDED, float_list, int_list, option, parse_size, text_list, token_or_id
from pipeline.config.tables import load_config, read_config_file
from pipeline.config.train import (
    Data,
    DrafterShape,
    Job,
    Objective,
    Optimizer,
    Schedule,
    TrainConfig,
    Tracking,
    parse_loss,
)

__all__ = ["Data", "DrafterShape", "EMBEDDED", "ExtractConfig", "Job", "Objective", "Optimizer", "Schedule",
           "TrainConfig", "Tracking", "float_list", "int_list", "load_config", "option", "parse_loss", "parse_size",
           "read_config_file", "text_list", "token_or_id"]
