"""Configuration and keys: the learner's configuration with its checks, CurveZMQ keys and ZAP. Imports nothing
else of the package."""
