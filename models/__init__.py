"""Flax NNX models of the paper (Inception-V3, GNMT, BigLSTM), their configs and data."""
