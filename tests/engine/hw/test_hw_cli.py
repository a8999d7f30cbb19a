from __future__ import annotations

import json

import pytest

from engine.cli import main


def test_hw_json_has_the_contract_keys_and_types(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hw", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert isinstance(report["chip"], str) and report["chip"]
    assert report["thermal_state"] in {"nominal", "fair", "serious", "critical", "unknown"}
    assert isinstance(report["rss_bytes"], int) and report["rss_bytes"] > 0
    assert isinstance(report["available_bytes"], int) and 0 < report["available_bytes"] <= report["total_bytes"]
    assert set(report["backends"]) == {"coreml", "mlx", "mps", "cuda", "cpu"}
    for probe in report["backends"].values():
        assert isinstance(probe["available"], bool) and isinstance(probe["reason"], str) and probe["reason"]
    assert report["backends"]["cpu"]["available"] is True
    mlx = report["backends"]["mlx"]
    assert mlx["device"] in ({"gpu", "cpu"} if mlx["available"] else {None})


def test_hw_summary_is_readable(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hw"]) == 0
    out = capsys.readouterr().out
    for heading in ("chip:", "thermal:", "memory:", "backends:"):
        assert heading in out
    assert "{" not in out


def test_hw_snapshot_cost_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hw", "--json", "--snapshot-cost"]) == 0
    assert json.loads(capsys.readouterr().out)["snapshot_cost_us"] > 0
