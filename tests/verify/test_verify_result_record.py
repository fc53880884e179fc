"""verify-cache's result record (pipeline/records/verify_result.py): it reads the `--json` document
as verify-cache has always written it (written out here by hand) and writes it back unchanged."""

from __future__ import annotations

import pytest

from pipeline.errors import PipelineError
from pipeline.records.verify_result import VerifyResult

DOC = {"cache": "s3://bucket/hs", "passed": True,
       "checks": [{"check": "manifest", "status": "pass", "summary": "schema 3, 2 committed shards, 2 selected", "evidence": {}},
                  {"check": "labels", "status": "inconclusive", "summary": "too few tokens", "evidence": {"tokens": 3}},
                  {"check": "tail_recompute", "status": "skipped", "summary": "skipped: no target", "evidence": {}}],
       "tokens": 120, "seconds": 0.5, "tokens_per_s": 240.0, "compute": None, "peak_rss_mb": 812.5}


def test_the_document_round_trips_in_its_key_order():
    result = VerifyResult.from_json(DOC)
    assert result.to_json() == DOC and list(result.to_json()) == list(DOC)
    assert [list(c) for c in result.to_json()["checks"]] == [["check", "status", "summary", "evidence"]] * 3
    assert result.with_status("inconclusive") == ["labels"] and result.with_status("fail") == []
    assert result.statuses() == {"manifest": "pass", "labels": "inconclusive", "tail_recompute": "skipped"}
    assert result.check("labels").evidence == {"tokens": 3}


def test_a_result_stopped_at_the_manifest_keeps_its_three_fields():
    stopped = {"cache": "/data/hs", "passed": False,
               "checks": [{"check": "manifest", "status": "fail", "summary": "no manifest.json", "evidence": {}}]}
    assert VerifyResult.from_json(stopped).to_json() == stopped


def test_a_document_that_is_not_one_is_named_in_one_line():
    with pytest.raises(PipelineError, match=r"^run/verify.json: not a `pipeline verify-cache --json` result "
                                            r"\(missing or bad field 'checks'\)$"):
        VerifyResult.from_json({"cache": "x", "passed": True}, where="run/verify.json")
    with pytest.raises(PipelineError, match="no check named 'recompute'"):
        VerifyResult.from_json(DOC).check("recompute")
