"""Put on PYTHONPATH by harness/label_reads.py (never installed): every process started with it
records each file it opens of a cache's label arrays (the `target_argmax` and `loss_mask` chunk
files) in $DFLASH_LABEL_READS/rank<RANK>.jsonl, with whether the open came from counting the
draft vocabulary's labels (a frame of `count_labels` on the stack) or from anything else
(training's batches). A Python audit hook: it sees the real opens, the code under test is unchanged."""

import json
import os
import sys

_DIR = os.environ.get("DFLASH_LABEL_READS")
_ARRAYS = ("/target_argmax/c", "/loss_mask/c")


def _counting(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_name == "count_labels":
            return True
        frame = frame.f_back
    return False


def _hook(event, args):
    if event != "open" or not isinstance(args[0], str) or not any(a in args[0] for a in _ARRAYS):
        return
    line = json.dumps({"path": args[0], "counting": _counting(sys._getframe(1))}) + "\n"
    # os.open is audited too, but the log's own path matches no label array: no recursion
    fd = os.open(os.path.join(_DIR, f"rank{os.environ.get('RANK', '0')}.jsonl"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


if _DIR:
    sys.addaudithook(_hook)
