"""The LLaVA family (``LlavaForConditionalGeneration``, one tile per image)."""
