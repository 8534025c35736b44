"""The front process: event loop, per-model queues and batchers, router, supervisor of workers."""
