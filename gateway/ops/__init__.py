"""What an operator reads.

metrics.py  GET /metrics in Prometheus format: request outcomes, latency histograms, the pool's state
pool_metrics.py  the pool's figures in /metrics (PoolCollector), per worker and in total
tracing.py  OpenTelemetry traces of generation requests across the hops (--otlp-endpoint)
"""
