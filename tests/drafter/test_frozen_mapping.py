"""The frozen embedding and lm_head that training and eval take from the target's safetensors:
the values safetensors itself reads, left mapped from the file when stored in the wanted dtype (so two
ranks of one node share one page-cache copy: issue 40, 5 GB a rank at the flagship vocabulary),
never written back to the checkpoint."""

import hashlib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pipeline.errors import PipelineError
from pipeline.target_model.loading import frozen_target_modules
from harness.prerequisites import missing


def _target(tmp_path: Path, *, tied: bool = False, dtype=torch.bfloat16) -> Path:
    g = torch.Generator().manual_seed(0)
    weights = {"model.embed_tokens.weight": torch.randn(96, 24, generator=g).to(dtype),
               "model.norm.weight": torch.ones(24, dtype=dtype)}
    if not tied:
        weights["lm_head.weight"] = torch.randn(96, 24, generator=g).to(dtype)
    save_file(weights, str(tmp_path / "model.safetensors"))
    return tmp_path


def _library(path: Path, name: str) -> torch.Tensor:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return f.get_tensor(name)


def _file_mappings(path: Path) -> list[tuple[int, int]]:
    """Address ranges of this process mapped from `path` (/proc/self/maps)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5] == str(path.resolve()):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((lo, hi))
    return ranges


def test_bf16_weights_are_the_librarys_and_mapped_from_the_file(tmp_path):
    if not Path("/proc/self/maps").is_file():
        missing("no /proc/self/maps on this system: cannot tell a mapped tensor from a copy")
    target = _target(tmp_path)
    embed, head = frozen_target_modules(target, torch.bfloat16)
    assert torch.equal(embed.weight, _library(target, "model.embed_tokens.weight"))
    assert torch.equal(head.weight, _library(target, "lm_head.weight"))
    assert not embed.weight.requires_grad and not head.weight.requires_grad
    mapped = _file_mappings(target / "model.safetensors")
    for weight in (embed.weight, head.weight):
        assert any(lo <= weight.data_ptr() < hi for lo, hi in mapped), "the weight is a copy, not the file's pages"


def test_another_dtype_is_read_and_cast(tmp_path):
    target = _target(tmp_path)
    embed, head = frozen_target_modules(target, torch.float32)
    assert embed.weight.dtype == torch.float32
    assert torch.equal(embed.weight, _library(target, "model.embed_tokens.weight").float())
    assert torch.equal(head.weight, _library(target, "lm_head.weight").float())


def test_tied_head_is_the_embedding(tmp_path):
    target = _target(tmp_path, tied=True)
    embed, head = frozen_target_modules(target, torch.bfloat16)
    assert head.weight.data_ptr() == embed.weight.data_ptr()
    ids = torch.tensor([3, 95])
    assert torch.equal(head(embed(ids).float().to(torch.bfloat16)), embed(ids) @ embed.weight.T)


def test_a_write_never_reaches_the_checkpoint(tmp_path):
    target = _target(tmp_path)
    before = hashlib.sha256((target / "model.safetensors").read_bytes()).hexdigest()
    embed, _ = frozen_target_modules(target, torch.bfloat16)
    with torch.no_grad():
        embed.weight.fill_(7.0)  # nothing in the pipeline does this; the mapping must still be private
    assert hashlib.sha256((target / "model.safetensors").read_bytes()).hexdigest() == before
    again, _ = frozen_target_modules(target, torch.bfloat16)
    assert torch.equal(again.weight, _library(target, "model.embed_tokens.weight"))


def test_no_embedding_is_one_line(tmp_path):
    save_file({"model.norm.weight": torch.ones(4)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(PipelineError, match="no embed_tokens weight"):
        frozen_target_modules(tmp_path, torch.bfloat16)


def test_a_broken_header_names_the_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes((12).to_bytes(8, "little") + b"not json....")
    with pytest.raises(PipelineError, match="model.safetensors: not a readable safetensors file"):
        frozen_target_modules(tmp_path, torch.bfloat16)
