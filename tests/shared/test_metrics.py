"""Every sample a process exports carries the process-wide labels; a sample's own label wins."""

from __future__ import annotations

from prometheus_client import Counter
from prometheus_client.parser import text_string_to_metric_families

from shared.metrics import FRAME_COUNTS, exposition

OWN_LABEL = Counter("tokenyard:test_own_model_label", "a metric that sets model_name itself", ["model_name"])


def _samples(text: bytes) -> dict[str, list[dict[str, str]]]:
    out: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample.labels)
    return out


def test_process_labels_reach_every_sample() -> None:
    FRAME_COUNTS.pair("test_socket", "received")[0] += 1
    samples = _samples(exposition({"model_name": "m", "replica": "r0"}))
    assert {"socket": "test_socket", "direction": "received", "model_name": "m", "replica": "r0"} in samples["tokenyard:frames_total"]
    assert all("model_name" in labels for many in samples.values() for labels in many)


def test_a_sample_keeps_its_own_label() -> None:
    OWN_LABEL.labels("other").inc()
    samples = _samples(exposition({"model_name": "m"}))
    assert samples["tokenyard:test_own_model_label_total"] == [{"model_name": "other"}]
