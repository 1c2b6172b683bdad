"""Real clients against a served model: lm-eval's harness, and aiperf and guidellm's load generators."""
