"""The target model: everything about loading and running it, in one package.

- facts.py: what a target directory is (config facts, digests, what it claims about a cache);
- resolve.py: which target directory a command uses;
- loading.py: its tokenizer, the whole model (optionally tensor-parallel, with its plan), or only
  the frozen embedding and lm_head;
- taps.py: which layers are tapped and what a tap index means;
- capture.py: one forward that returns the tapped hidden states and the target's predictions;
- live.py: the target beside a drafter during speculative decoding (its caches, verification);
- plain_rows.py: plain decoding of several prompts at once (generate's batches, eval's reference);
- kernels.py: which kernels the linear-attention ops were bound to and which ran (the cache's
  kernel provenance);
- internals/: every use of transformers' internals (tree.py: the tree-verification patches;
  versions.py: one adapter per change between the supported transformers releases).

The names most commands need are importable from the package itself.
"""

from pipeline.target_model.facts import (
    TOKENIZER_FILES,
    TargetFacts,
    chat_template_sha256,
    config_sha256,
    end_of_turn_ids,
    identity_claims,
    read_target_facts,
    reserved_token_ids,
)
from pipeline.target_model.loading import frozen_target_modules, load_target, load_target_on_layout, load_tokenizer
from pipeline.target_model.resolve import RecordedTarget, recorded_in_cache, resolve_target

__all__ = ["TOKENIZER_FILES", "RecordedTarget", "TargetFacts", "chat_template_sha256", "config_sha256", "end_of_turn_ids",
           "frozen_target_modules", "identity_claims", "load_target", "load_target_on_layout", "load_tokenizer",
           "read_target_facts", "recorded_in_cache", "reserved_token_ids", "resolve_target"]
