"""The learned time to first token against the observed one, per backend (docs/metrics.md,
docs/routing.md "Time to first token, learned per replica"): counted only where the gateway
had learned a line for the backend it chose."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter


class FirstTokenSeries:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.predictions = Counter(
            "gateway_ttft_predictions",
            "Streams whose time to first token was both predicted (by the backend's learned"
            " line, when it was chosen) and observed: the count behind the two sums below.",
            ["backend"],
            registry=registry,
        )
        self.predicted_seconds = Counter(
            "gateway_ttft_predicted_seconds",
            "Summed predicted time to first token of those streams; over"
            " gateway_ttft_observed_seconds_total it shows how far the prediction is off.",
            ["backend"],
            registry=registry,
        )
        self.observed_seconds = Counter(
            "gateway_ttft_observed_seconds",
            "Summed observed time to first token (sent upstream to first byte) of those streams.",
            ["backend"],
            registry=registry,
        )
