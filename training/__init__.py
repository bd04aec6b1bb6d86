"""kvp-cpp training pipeline: traces, RL training, evaluation, export."""
