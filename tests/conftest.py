import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def embedded():
    from pipeline import embedded
    return embedded


@pytest.fixture(scope="session")
def tokenizer(embedded):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(embedded.TARGET_DIR, local_files_only=True)


@pytest.fixture(scope="session")
def target(embedded):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    return AutoModelForCausalLM.from_pretrained(embedded.TARGET_DIR, local_files_only=True, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def heldout_rows(embedded):
    from stages.summary import read_jsonl
    return read_jsonl(embedded.HELDOUT_DATA)


@pytest.fixture(scope="session")
def train_rows(embedded):
    from stages.summary import read_jsonl
    return read_jsonl(embedded.TRAIN_DATA)
