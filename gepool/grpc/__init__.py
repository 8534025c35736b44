"""Triton's KServe v2 gRPC service (package ``inference``), served by the gateway beside HTTP."""
