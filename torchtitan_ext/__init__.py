"""torchtitan_ext: PyTorch-native LLM pretraining."""
