"""The leaves every gepool package may import: model config, the repository scan, config rendering, errors."""
