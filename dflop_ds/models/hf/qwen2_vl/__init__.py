"""The Qwen2-VL family (Qwen2-VL and Qwen2.5-VL: native-resolution patches, M-RoPE, images and videos)."""
