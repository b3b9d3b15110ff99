"""What an operator reads.

metrics.py  GET /metrics in Prometheus format: request outcomes, latency histograms, the pool's state
tracing.py  OpenTelemetry traces of generation requests across the hops (--otlp-endpoint)
"""
