"""Model definitions, written for tensor and pipeline parallelism."""
