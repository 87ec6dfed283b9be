"""Names for parsed and written JSON (the demo's results.json and seed_result.json, the study's
plan, metrics.jsonl records, the judge's training record), so that a signature says which one it takes."""

from __future__ import annotations

from typing import Mapping, Union

JsonValue = Union[None, bool, int, float, str, list["JsonValue"], dict[str, "JsonValue"]]
JsonObject = dict[str, JsonValue]  # built here, written with json.dump
JsonRecord = Mapping[str, JsonValue]  # read with json.load (a seed's result, the plan, one step's metrics)

__all__ = ["JsonObject", "JsonRecord", "JsonValue"]
