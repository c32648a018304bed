"""Evaluation data: the held-out standard-library text and the synthetic passkey prompts."""
