"""The Qwen3-VL family (native-resolution patches, deepstack visual features, interleaved M-RoPE; images)."""
