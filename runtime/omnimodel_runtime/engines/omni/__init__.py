"""Qwen2.5-Omni split into its three stages: thinker, talker and code2wav (transformers)."""
