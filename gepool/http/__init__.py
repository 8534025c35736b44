"""The sidecar: Triton's KServe v2 HTTP protocol and Prometheus metrics, as a client of the front."""
