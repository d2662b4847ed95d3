"""The LLaVA-OneVision family (AnyRes tiles, pooled video frames)."""
