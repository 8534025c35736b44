"""Worker processes: one model instance each, executing batches in place in a slot ring."""
