"""Every Prometheus series the gateway exports (`series`), the tenants', the LoRA adapters' and
the process's apart (`tenants`, `adapters`, `process`), and the registry that reads them as one
over worker processes (`registry`): docs/metrics.md."""

from prefix_gateway.metrics.series import Metrics

__all__ = ["Metrics"]
