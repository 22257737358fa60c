"""Builders a job YAML can name (`model.builder: examples.<module>:build`), run from the repository root."""
